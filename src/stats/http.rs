//! The `--metrics ADDR` endpoint: GET /metrics answers the Prometheus text exposition;
//! everything else 404.
//!
//! One thread of its own runs a single-threaded tokio runtime with hyper's HTTP/1 server,
//! away from the FUSE workers (which are pinned and never wait on it). Bounded: at most
//! [`CONNECTIONS_MAX`] connections (more are closed at once), a request head of at most
//! [`REQUEST_BYTES_MAX`] read within [`HEAD_TIMEOUT`], and a connection lives at most
//! [`CONNECTION_LIFETIME`] (a scraper's keep-alive connection is simply opened again).

use std::{
    convert::Infallible,
    net::{SocketAddr, TcpListener, ToSocketAddrs as _},
    sync::Arc,
    time::Duration,
};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{body::Incoming, header, Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

use super::Stats;

/// The port the README suggests for `--metrics` (next to node_exporter's 9100 range, and
/// free of the well-known exporters' defaults).
pub(crate) const DEFAULT_PORT: u16 = 9567;

/// Connections served at once; a scraper needs one, a person with curl another.
const CONNECTIONS_MAX: usize = 8;
/// hyper's smallest read buffer, which bounds a request's head.
const REQUEST_BYTES_MAX: usize = 8192;
/// A client that has not sent a whole request head by then is disconnected.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest a connection is kept, idle or not.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// Listens on `addr` (`HOST:PORT`), before anything is mounted, so that a port in use
/// fails the mount with the reason.
pub(crate) fn bind(addr: &str) -> Result<TcpListener> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .with_context(|| {
            format!("--metrics {addr}: not an address to listen on (HOST:PORT, e.g. 127.0.0.1:{DEFAULT_PORT})")
        })?
        .collect();
    let mut last = None;
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some((a, e)),
        }
    }
    match last {
        Some((a, e)) => bail!("--metrics {addr}: cannot listen on {a}: {e}"),
        None => bail!("--metrics {addr}: the name resolves to no address"),
    }
}

/// Serves `listener` on a thread of its own until the process exits.
pub(crate) fn serve(listener: TcpListener, stats: Arc<Stats>) -> Result<SocketAddr> {
    let local = listener
        .local_addr()
        .context("--metrics: the bound address")?;
    listener
        .set_nonblocking(true)
        .context("--metrics: make the socket non-blocking")?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .context("--metrics: start its runtime")?;
    std::thread::Builder::new()
        .name("etcfs-metrics".into())
        .spawn(move || runtime.block_on(accept(listener, stats)))
        .context("--metrics: spawn its thread")?;
    Ok(local)
}

async fn accept(listener: TcpListener, stats: Arc<Stats>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            log::error!("metrics endpoint: {e}; no metrics will be served");
            return;
        }
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors, say: wait rather than spin on the error.
                log::warn!("metrics endpoint: accept: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let stats = stats.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let stats = stats.clone();
                async move { Ok::<_, Infallible>(respond(req.method(), req.uri().path(), &stats)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(REQUEST_BYTES_MAX)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, conn).await;
            drop(slot);
        });
    }
}

fn respond(method: &Method, path: &str, stats: &Stats) -> Response<Full<Bytes>> {
    route(method, path, || stats.prometheus())
}

/// The answer to `method path`, with `metrics` producing the exposition.
fn route(method: &Method, path: &str, metrics: impl FnOnce() -> String) -> Response<Full<Bytes>> {
    let (status, content_type, body) = if method == Method::GET && path == "/metrics" {
        (
            StatusCode::OK,
            prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            metrics(),
        )
    } else {
        (
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "etcfs serves only GET /metrics here\n".to_owned(),
        )
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_metrics_is_served() {
        let ok = route(&Method::GET, "/metrics", || "m 1\n".into());
        assert_eq!(ok.status(), StatusCode::OK);
        assert!(ok.headers()[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4"));
        for (method, path) in [
            (Method::GET, "/"),
            (Method::GET, "/metrics/x"),
            (Method::POST, "/metrics"),
            (Method::DELETE, "/metrics"),
        ] {
            let r = route(&method, path, || panic!("no metrics for {method} {path}"));
            assert_eq!(r.status(), StatusCode::NOT_FOUND, "{method} {path}");
        }
    }

    #[test]
    fn a_port_in_use_is_refused_with_the_reason() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let err = format!("{:#}", bind(&addr).unwrap_err());
        assert!(
            err.contains("cannot listen") && err.contains(&addr),
            "{err}"
        );
        let err = format!("{:#}", bind("no-port-here").unwrap_err());
        assert!(err.contains("HOST:PORT"), "{err}");
    }
}
