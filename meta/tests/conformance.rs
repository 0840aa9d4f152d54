//! The KvBackend conformance suite against the model (always) and a real etcd (when
//! `ETCD_ENDPOINTS` is set).

use std::{
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use meta::{
    clock::ManualClock,
    etcd::{EtcdBackend, EtcdConfig},
    model::MemEtcd,
    types::Timespec,
};

fn unique_prefix() -> Vec<u8> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos();
    format!("/etcfs-test/{nanos:x}-{}/", std::process::id()).into_bytes()
}

fn endpoints() -> Option<Vec<String>> {
    match std::env::var("ETCD_ENDPOINTS") {
        Ok(s) if !s.trim().is_empty() => Some(s.split(',').map(|e| e.trim().to_owned()).collect()),
        _ => None,
    }
}

#[tokio::test]
async fn conformance_model() {
    let kv = MemEtcd::new(Arc::new(ManualClock::new(Timespec::new(1_700_000_000, 0))));
    meta::conformance::run(&kv, &unique_prefix()).await;
}

#[tokio::test]
async fn conformance_real_etcd() {
    let Some(eps) = endpoints() else {
        eprintln!("SKIP: conformance_real_etcd needs a real etcd (set ETCD_ENDPOINTS)");
        return;
    };
    let kv = EtcdBackend::connect(&EtcdConfig::new(eps))
        .await
        .expect("connect to etcd");
    meta::conformance::run(&kv, &unique_prefix()).await;
}

#[tokio::test]
async fn unreachable_endpoint_fails_fast() {
    let start = std::time::Instant::now();
    let cfg = EtcdConfig::new(vec!["http://127.0.0.1:1".to_owned()]);
    let r = EtcdBackend::connect(&cfg).await;
    let took = start.elapsed();
    let err = r.expect_err("nothing listens on port 1");
    eprintln!("unreachable etcd: {err} (after {took:?})");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(
        matches!(err, meta::error::KvError::Unavailable(_)),
        "{err:?}"
    );
}

#[tokio::test]
async fn silent_endpoint_fails_within_5s() {
    // A listener that accepts TCP but never speaks HTTP/2: the connect timeout must fire.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let start = std::time::Instant::now();
    let cfg = EtcdConfig::new(vec![format!("http://{addr}")]);
    let err = EtcdBackend::connect(&cfg)
        .await
        .expect_err("nobody answers");
    let took = start.elapsed();
    eprintln!("silent etcd: {err} (after {took:?})");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(
        matches!(err, meta::error::KvError::Unavailable(_)),
        "{err:?}"
    );
    drop(listener);
}
