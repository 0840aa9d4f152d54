//! The real backend: etcd v3 through `etcd-client`.
//!
//! Every call is bounded by `request_timeout` and connecting is bounded by
//! `connect_timeout` plus one probe request, because `etcd-client` connects lazily: an
//! unreachable endpoint would otherwise surface only as a hang on the first request.

use std::{
    sync::{Arc, RwLock},
    time::Duration,
};

use etcd_client::{
    AlarmAction, AlarmType, Certificate, Client, Compare as EcCompare, CompareOp as EcOp,
    ConnectOptions, DeleteOptions, EventType, GetOptions, Identity, PutOptions, SortOrder,
    SortTarget, TlsOptions, Txn as EcTxn, TxnOp as EcTxnOp, TxnOpResponse as EcResp, WatchOptions,
};
use tokio::sync::mpsc;

use crate::{
    error::KvError,
    kv::{
        Alarm, AlarmKind, BoxFut, ClusterMember, ClusterStatus, CompareOp, CompareTarget,
        EventKind, KeyValue, KvBackend, LeaseGrant, LeaseTtl, RangeRequest, RangeResponse, Txn,
        TxnOp, TxnOpResponse, TxnResponse, WatchEvent, WatchStream, WATCH_BATCHES_MAX,
    },
};

/// Connection settings.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// Endpoint URLs (`http://host:port`, or `https://host:port` with [`EtcdConfig::tls`]).
    pub endpoints: Vec<String>,
    /// Bound on establishing the connection (and the probe request).
    pub connect_timeout: Duration,
    /// Bound on every request.
    pub request_timeout: Duration,
    /// TLS for `https://` endpoints: the CA that signed the servers' certificates and
    /// this client's certificate, if the cluster asks for one.
    pub tls: Option<EtcdTls>,
    /// An etcd user to authenticate as (etcd with `auth enable`).
    pub auth: Option<EtcdAuth>,
    /// The key read to prove the cluster answers: one the user may read (a user whose
    /// role covers only a filesystem's prefix may read nothing outside it).
    pub probe_key: Vec<u8>,
    /// Send the probe again while etcd is unavailable, until `connect_timeout`: a mount
    /// started during a leader election (a member killed, its successor not yet elected)
    /// waits for the new leader instead of failing. Off for a caller that polls itself.
    pub probe_retry: bool,
}

impl EtcdConfig {
    /// Defaults: 4 s to connect and answer a probe, 5 s per request, no TLS, no user.
    pub fn new(endpoints: Vec<String>) -> Self {
        EtcdConfig {
            endpoints,
            connect_timeout: Duration::from_secs(4),
            request_timeout: Duration::from_secs(5),
            tls: None,
            auth: None,
            probe_key: b"\0etcfs-probe".to_vec(),
            probe_retry: true,
        }
    }
}

/// TLS material, as PEM text (the caller reads the files, so it can name the one that
/// could not be read).
#[derive(Clone)]
pub struct EtcdTls {
    /// The CA certificate(s) the servers' certificates must chain to.
    pub ca_pem: Vec<u8>,
    /// This client's certificate and private key, for a cluster with
    /// `--client-cert-auth`.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The private key never reaches a log line.
        f.debug_struct("EtcdTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("client_cert", &self.identity.is_some())
            .finish()
    }
}

/// An etcd user and its password.
#[derive(Clone)]
pub struct EtcdAuth {
    /// The etcd user name.
    pub user: String,
    password: String,
}

impl EtcdAuth {
    /// The user `user` with password `password`.
    pub fn new(user: String, password: String) -> Self {
        EtcdAuth { user, password }
    }
}

impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The password never reaches a log line or an error message.
        f.debug_struct("EtcdAuth")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// A connected etcd backend.
#[derive(Clone)]
pub struct EtcdBackend {
    /// Replaced by [`EtcdBackend::reauthenticate`]; requests clone it (cheap: channels).
    client: Arc<RwLock<(Client, u64)>>,
    /// How to log in again when etcd no longer knows the token (`None`: no user).
    login: Option<Arc<Login>>,
    request_timeout: Duration,
}

/// What re-authentication needs: etcd-client authenticates once, in `Client::connect`,
/// and keeps that token; etcd forgets simple tokens after `--auth-token-ttl` (5 min) without
/// use and on restart, and JWT tokens expire, after which every request answers "invalid
/// auth token" until the client logs in again.
struct Login {
    cfg: EtcdConfig,
    /// Serialises logins; holds the generation of the client the last one produced.
    gate: tokio::sync::Mutex<u64>,
}

impl std::fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend").finish_non_exhaustive()
    }
}

/// Whether etcd refused the request's auth token (expired, or from before a restart) as
/// opposed to its credentials: logging in again fixes it.
fn is_stale_token(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => s.message().contains("invalid auth token"),
        _ => false,
    }
}

fn map_err(e: etcd_client::Error) -> KvError {
    use etcd_client::Error as E;
    match e {
        E::GRpcStatus(s) => {
            // A connection that failed (a TLS alert, a plaintext server) is a status that
            // says only "transport error"; its cause says what went wrong.
            let msg = match std::error::Error::source(&s).map(with_causes) {
                Some(causes) if causes.starts_with(s.message()) => causes,
                Some(causes) => format!("{}: {causes}", s.message()),
                None => s.message().to_owned(),
            };
            if is_election(&msg) {
                // A leader election (or an overloaded leader) under way: etcd may not have
                // applied the request, or may have; the caller's retry or marker decides,
                // as for any unanswered request.
                KvError::Unavailable(msg)
            } else if msg.contains("too many operations") {
                KvError::TooManyOps
            } else if msg.contains("request is too large") {
                KvError::RequestTooLarge
            } else if msg.contains("database space exceeded") {
                KvError::NoSpace(msg)
            } else if msg.contains("lease not found") {
                KvError::LeaseNotFound
            } else if msg.contains("duplicate key") {
                KvError::Invalid(msg)
            } else if msg.contains("compacted") {
                KvError::Compacted {
                    compact_revision: 0,
                }
            } else if matches!(
                s.code(),
                tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
            ) || msg.contains("authentication")
                || msg.contains("user name is empty")
            {
                KvError::Auth(auth_message(&msg))
            } else if matches!(
                s.code(),
                tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
            ) || (s.code() == tonic::Code::Unknown && msg.contains("transport error"))
            {
                // tonic reports a connection that broke mid-request (a member killed) as
                // an unknown status "transport error": etcd is unreachable, not erring.
                KvError::Unavailable(msg)
            } else {
                KvError::Other(msg)
            }
        }
        E::TransportError(t) => KvError::Unavailable(with_causes(&t)),
        E::IoError(io) => KvError::Unavailable(io.to_string()),
        E::LeaseKeepAliveError(m) if m.contains("lease not found") => KvError::LeaseNotFound,
        other => KvError::Other(other.to_string()),
    }
}

/// Whether etcd's message says it could not serve the request for want of a (stable)
/// leader, or of capacity: "not leader" is FailedPrecondition and "too many requests"
/// ResourceExhausted to gRPC, but both pass with the election, as do the Unavailable ones.
fn is_election(msg: &str) -> bool {
    [
        "etcdserver: not leader",
        "etcdserver: no leader",
        "etcdserver: leader changed",
        "proposal dropped",
        "etcdserver: too many requests",
        "etcdserver: request timed out",
    ]
    .iter()
    .any(|w| msg.contains(w))
}

/// etcd's words for an auth refusal, with what to do about it.
fn auth_message(msg: &str) -> String {
    let msg = msg.trim_start_matches("etcdserver: ");
    if msg.contains("user name is empty") {
        format!("{msg}: this etcd has authentication enabled and needs a user")
    } else if msg.contains("invalid user ID or password") {
        format!("{msg} (check the user and password)")
    } else if msg.contains("authentication is not enabled") {
        format!("{msg}: this etcd takes no user and password")
    } else if msg.contains("permission denied") {
        format!("{msg}: the user's roles do not grant read-write on this filesystem's prefix")
    } else {
        msg.to_owned()
    }
}

async fn bounded<T>(
    timeout: Duration,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, KvError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r.map_err(map_err),
        Err(_) => Err(KvError::Unavailable(format!(
            "{what} timed out after {timeout:?}"
        ))),
    }
}

fn kv_from(kv: &etcd_client::KeyValue) -> KeyValue {
    KeyValue {
        key: kv.key().to_vec(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        version: kv.version(),
        lease: kv.lease(),
    }
}

fn get_options(req: &RangeRequest) -> GetOptions {
    let mut o = GetOptions::new()
        .with_limit(req.limit)
        .with_revision(req.revision);
    if let Some(end) = &req.range_end {
        o = o.with_range(end.clone());
    }
    if req.keys_only {
        o = o.with_keys_only();
    }
    if req.descending {
        o = o.with_sort(SortTarget::Key, SortOrder::Descend);
    }
    o
}

fn range_from(resp: &etcd_client::GetResponse) -> RangeResponse {
    RangeResponse {
        kvs: resp.kvs().iter().map(kv_from).collect(),
        more: resp.more(),
        count: resp.count(),
        revision: resp.header().map_or(0, |h| h.revision()),
    }
}

fn op_to(op: &TxnOp) -> EcTxnOp {
    match op {
        TxnOp::Put(p) => {
            let o = (p.lease != 0).then(|| PutOptions::new().with_lease(p.lease));
            EcTxnOp::put(p.key.clone(), p.value.clone(), o)
        }
        TxnOp::Delete(d) => {
            let mut o = DeleteOptions::new();
            if let Some(end) = &d.range_end {
                o = o.with_range(end.clone());
            }
            if d.prev_kv {
                o = o.with_prev_key();
            }
            EcTxnOp::delete(d.key.clone(), Some(o))
        }
        TxnOp::Range(r) => EcTxnOp::get(r.key.clone(), Some(get_options(r))),
    }
}

fn compare_to(c: &crate::kv::Compare) -> EcCompare {
    let op = match c.op {
        CompareOp::Equal => EcOp::Equal,
        CompareOp::Greater => EcOp::Greater,
        CompareOp::Less => EcOp::Less,
        CompareOp::NotEqual => EcOp::NotEqual,
    };
    let key = c.key.clone();
    let cmp = match &c.target {
        CompareTarget::Version(v) => EcCompare::version(key, op, *v),
        CompareTarget::CreateRevision(v) => EcCompare::create_revision(key, op, *v),
        CompareTarget::ModRevision(v) => EcCompare::mod_revision(key, op, *v),
        CompareTarget::Value(v) => EcCompare::value(key, op, v.clone()),
    };
    match &c.range_end {
        Some(end) => cmp.with_range(end.clone()),
        None => cmp,
    }
}

/// etcd-client's options for `cfg`, with the user when `cfg` has one.
fn connect_options(cfg: &EtcdConfig) -> ConnectOptions {
    let mut opts = ConnectOptions::new()
        .with_connect_timeout(cfg.connect_timeout)
        .with_timeout(cfg.request_timeout)
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
    if let Some(tls) = &cfg.tls {
        let mut t = TlsOptions::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
        if let Some((cert, key)) = &tls.identity {
            t = t.identity(Identity::from_pem(cert, key));
        }
        opts = opts.with_tls(t);
    }
    if let Some(a) = &cfg.auth {
        opts = opts.with_user(a.user.clone(), a.password.clone());
    }
    opts
}

/// An error with its causes: tonic's transport errors say only "transport error" at the
/// top, and the cause (a refused certificate, a closed connection) is what a user needs.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let c_s = c.to_string();
        if !s.contains(&c_s) {
            s.push_str(": ");
            s.push_str(&c_s);
        }
        cur = c.source();
    }
    s
}

impl EtcdBackend {
    /// Connects and probes the cluster; an unreachable or silent cluster is an
    /// `Unavailable` error within `connect_timeout`, never a hang. Refused credentials are
    /// an `Auth` error.
    pub async fn connect(cfg: &EtcdConfig) -> Result<Self, KvError> {
        if cfg.endpoints.is_empty() {
            return Err(KvError::Invalid("no etcd endpoints".into()));
        }
        let eps = cfg.endpoints.join(",");
        let deadline = tokio::time::Instant::now() + cfg.connect_timeout;
        match Self::connect_and_probe(cfg, deadline).await {
            Ok(b) => Ok(b),
            Err(KvError::Auth(m)) => Err(KvError::Auth(format!("{m} (etcd at {eps})"))),
            Err(KvError::Invalid(m)) => Err(KvError::Invalid(format!("etcd at {eps}: {m}"))),
            Err(KvError::Unavailable(m)) if m.starts_with(SILENT) => {
                Err(KvError::Unavailable(format!(
                    "etcd at {eps} {m}{}",
                    tls_hint(cfg, &KvError::Unavailable(m.clone()))
                )))
            }
            Err(e) => Err(KvError::Unavailable(format!(
                "etcd at {eps}: {e}{}",
                tls_hint(cfg, &e)
            ))),
        }
    }

    async fn connect_and_probe(
        cfg: &EtcdConfig,
        deadline: tokio::time::Instant,
    ) -> Result<Self, KvError> {
        let silent = || KvError::Unavailable(format!("{SILENT} within {:?}", cfg.connect_timeout));
        let connect = Client::connect(cfg.endpoints.clone(), Some(connect_options(cfg)));
        let client = match tokio::time::timeout_at(deadline, connect).await {
            Ok(c) => c.map_err(map_err)?,
            Err(_) => return Err(silent()),
        };
        let backend = EtcdBackend {
            client: Arc::new(RwLock::new((client, 0))),
            login: cfg.auth.as_ref().map(|_| {
                Arc::new(Login {
                    cfg: cfg.clone(),
                    gate: tokio::sync::Mutex::new(0),
                })
            }),
            request_timeout: cfg.request_timeout,
        };
        // Probe: a bounded read proves the cluster answers (and has a leader for
        // linearizable reads) before the daemon commits to using it. During an election a
        // member without a leader drops the read, and the member that was leader refuses
        // connections: each attempt is abandoned after PROBE_ATTEMPT and sent again, to
        // whichever member answers, until the deadline. The last error is what is reported
        // (a refused certificate says so, not just "no answer").
        let probe = RangeRequest::key(cfg.probe_key.clone())
            .limit(1)
            .keys_only();
        // An attempt cut short by the deadline says nothing, so the last error that did is
        // kept: a loaded CI machine reported a rogue CA as "did not answer" when its last
        // attempt had only a few milliseconds left.
        let mut said: Option<KvError> = None;
        let mut pause = Duration::from_millis(50);
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(left.min(PROBE_ATTEMPT), backend.range(probe.clone())).await
            {
                Ok(Ok(_)) => return Ok(backend),
                Ok(Err(e @ KvError::Unavailable(_))) => said = Some(e),
                Ok(Err(e)) => return Err(e),
                Err(_) => {}
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if !cfg.probe_retry || left <= pause {
                return Err(said.unwrap_or_else(silent));
            }
            log::debug!(
                "etcd probe: {}; trying again",
                said.as_ref()
                    .map_or_else(|| silent().to_string(), ToString::to_string)
            );
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(400));
        }
    }

    fn current(&self) -> (Client, u64) {
        self.client
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Runs one request (built by `f` on a client) within the request timeout; a request
    /// refused for a stale auth token logs in again and is sent once more.
    async fn call<T, F, Fut>(&self, what: &str, f: F) -> Result<T, KvError>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let (client, generation) = self.current();
        match tokio::time::timeout(self.request_timeout, f(client)).await {
            Ok(Err(e)) if self.login.is_some() && is_stale_token(&e) => {}
            Ok(r) => return r.map_err(map_err),
            Err(_) => {
                return Err(KvError::Unavailable(format!(
                    "{what} timed out after {:?}",
                    self.request_timeout
                )))
            }
        }
        self.reauthenticate(generation).await?;
        let (client, _) = self.current();
        bounded(self.request_timeout, what, f(client)).await
    }

    /// Logs in again, once for all the requests that found the token of client generation
    /// `seen` stale. A new client, not `set_client_auth` on the old one: etcd-client puts
    /// its current token on every request, the login too, and etcd checks the token a
    /// raft request carries before applying it, so the login could be refused as well (not
    /// verified against etcd; a fresh client carries no token, so the question never
    /// arises). Its connection is the cost, once per expiry.
    async fn reauthenticate(&self, seen: u64) -> Result<(), KvError> {
        let Some(login) = &self.login else {
            return Ok(());
        };
        let mut generation = login.gate.lock().await;
        if *generation != seen {
            return Ok(());
        }
        let cfg = &login.cfg;
        let client = bounded(
            cfg.connect_timeout,
            "etcd login",
            Client::connect(cfg.endpoints.clone(), Some(connect_options(cfg))),
        )
        .await?;
        *generation += 1;
        *self
            .client
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = (client, *generation);
        log::info!(
            "etcd: logged in again as user {:?} (the auth token had expired)",
            cfg.auth.as_ref().map_or("", |a| a.user.as_str())
        );
        Ok(())
    }
}

/// How long one probe attempt waits: longer than any healthy etcd takes for a key-only
/// read of one key, shorter than a member without a leader keeps a read it dropped.
const PROBE_ATTEMPT: Duration = Duration::from_secs(1);

/// The words of an etcd that said nothing at all.
const SILENT: &str = "did not answer";

/// What to check when a TLS connection failed without etcd saying why.
fn tls_hint(cfg: &EtcdConfig, e: &KvError) -> &'static str {
    let text = e.to_string().to_lowercase();
    let https = cfg.endpoints.iter().any(|e| e.starts_with("https://"));
    let no_client_cert = cfg.tls.as_ref().is_some_and(|t| t.identity.is_none());
    if text.contains("connection refused") {
        ""
    } else if !https {
        if text.contains("transport error") {
            " (if this etcd serves TLS, give the endpoints as https:// with --etcd-cacert)"
        } else {
            ""
        }
    } else if no_client_cert
        && [
            "badcertificate",
            "certificaterequired",
            "broken pipe",
            "connection closed",
        ]
        .iter()
        .any(|w| text.contains(w))
    {
        " (the server asks for a client certificate: give --etcd-cert and --etcd-key)"
    } else if text.contains("certificate") || text.contains("tls") || text.contains("handshake") {
        " (TLS handshake failed: check that --etcd-cacert signed the server's certificate, \
         that the certificate names the endpoint's host, and that --etcd-cert/--etcd-key are \
         a client certificate the server's CA trusts)"
    } else if no_client_cert {
        // A server that wants a certificate may just close the connection, or let it hang.
        " (if the server requires client certificates, give --etcd-cert and --etcd-key)"
    } else {
        ""
    }
}

impl KvBackend for EtcdBackend {
    fn range(&self, req: RangeRequest) -> BoxFut<'_, Result<RangeResponse, KvError>> {
        Box::pin(async move {
            let resp = self
                .call("range", |c| {
                    let mut kv = c.kv_client();
                    let (key, opts) = (req.key.clone(), get_options(&req));
                    async move { kv.get(key, Some(opts)).await }
                })
                .await?;
            Ok(range_from(&resp))
        })
    }

    fn txn(&self, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>> {
        Box::pin(async move {
            let resp = self
                .call("txn", |c| {
                    let t = EcTxn::new()
                        .when(txn.compares.iter().map(compare_to).collect::<Vec<_>>())
                        .and_then(txn.success.iter().map(op_to).collect::<Vec<_>>())
                        .or_else(txn.failure.iter().map(op_to).collect::<Vec<_>>());
                    let mut kv = c.kv_client();
                    async move { kv.txn(t).await }
                })
                .await?;
            let responses = resp
                .op_responses()
                .into_iter()
                .map(|r| match r {
                    EcResp::Put(_) => TxnOpResponse::Put,
                    EcResp::Delete(d) => TxnOpResponse::Delete {
                        deleted: d.deleted(),
                        prev_kvs: d.prev_kvs().iter().map(kv_from).collect(),
                    },
                    EcResp::Get(g) => TxnOpResponse::Range(range_from(&g)),
                    // We never send nested transactions.
                    EcResp::Txn(_) => TxnOpResponse::Put,
                })
                .collect();
            Ok(TxnResponse {
                succeeded: resp.succeeded(),
                revision: resp.header().map_or(0, |h| h.revision()),
                responses,
            })
        })
    }

    fn lease_grant(&self, ttl_s: i64) -> BoxFut<'_, Result<LeaseGrant, KvError>> {
        Box::pin(async move {
            let r = self
                .call("lease grant", |c| {
                    let mut l = c.lease_client();
                    async move { l.grant(ttl_s, None).await }
                })
                .await?;
            Ok(LeaseGrant {
                id: r.id(),
                ttl_s: r.ttl(),
            })
        })
    }

    fn lease_keepalive(&self, id: i64) -> BoxFut<'_, Result<i64, KvError>> {
        Box::pin(async move {
            let ttl = self
                .call("lease keepalive", |c| {
                    let mut l = c.lease_client();
                    async move {
                        let (mut keeper, mut stream) = l.keep_alive(id).await?;
                        keeper.keep_alive().await?;
                        let msg = stream.message().await?;
                        Ok(msg.map_or(0, |m| m.ttl()))
                    }
                })
                .await?;
            if ttl <= 0 {
                return Err(KvError::LeaseNotFound);
            }
            Ok(ttl)
        })
    }

    fn lease_revoke(&self, id: i64) -> BoxFut<'_, Result<(), KvError>> {
        Box::pin(async move {
            self.call("lease revoke", |c| {
                let mut l = c.lease_client();
                async move { l.revoke(id).await }
            })
            .await?;
            Ok(())
        })
    }

    fn watch(
        &self,
        key: Vec<u8>,
        range_end: Vec<u8>,
        start_revision: i64,
    ) -> BoxFut<'_, Result<WatchStream, KvError>> {
        Box::pin(async move {
            let mut opts = WatchOptions::new().with_range(range_end);
            if start_revision > 0 {
                opts = opts.with_start_revision(start_revision);
            }
            if self.login.is_some() {
                // etcd answers a watch whose token is stale or whose user may not read
                // the range with a creation response that is also a cancellation, which
                // etcd-client swallows: the stream would then stay silent. A read of the
                // range first logs in again, or reports the refusal.
                self.range(RangeRequest::key(key.clone()).limit(1).keys_only())
                    .await?;
            }
            let (mut watcher, mut stream) = self
                .call("watch", |c| {
                    let mut w = c.watch_client();
                    let (key, opts) = (key.clone(), opts.clone());
                    async move { w.watch(key, Some(opts)).await }
                })
                .await?;
            let (tx, rx) = mpsc::channel(WATCH_BATCHES_MAX);
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        () = tx.closed() => break,
                        msg = stream.message() => {
                            let batch = match msg {
                                Ok(Some(resp)) => {
                                    if resp.compact_revision() > 0 {
                                        Err(KvError::Compacted {
                                            compact_revision: resp.compact_revision(),
                                        })
                                    } else if resp.canceled() {
                                        Err(KvError::Other(format!(
                                            "watch canceled: {}", resp.cancel_reason()
                                        )))
                                    } else if resp.events().is_empty() {
                                        continue;
                                    } else {
                                        Ok(resp.events().iter().filter_map(|e| {
                                            let kv = kv_from(e.kv()?);
                                            let kind = match e.event_type() {
                                                EventType::Put => EventKind::Put,
                                                EventType::Delete => EventKind::Delete,
                                            };
                                            Some(WatchEvent { kind, kv })
                                        }).collect())
                                    }
                                }
                                Ok(None) => Err(KvError::Unavailable("watch stream ended".into())),
                                Err(e) => Err(map_err(e)),
                            };
                            let end = batch.is_err();
                            if tx.send(batch).await.is_err() || end {
                                break;
                            }
                        }
                    }
                }
                let _ = watcher.cancel().await;
            });
            Ok(rx)
        })
    }

    fn lease_time_to_live(&self, id: i64) -> BoxFut<'_, Result<LeaseTtl, KvError>> {
        Box::pin(async move {
            let r = self
                .call("lease time-to-live", |c| {
                    let mut l = c.lease_client();
                    async move { l.time_to_live(id, None).await }
                })
                .await?;
            // etcd answers an unknown (expired, revoked) lease with a TTL of -1.
            if r.ttl() < 0 {
                return Err(KvError::LeaseNotFound);
            }
            Ok(LeaseTtl {
                remaining_s: r.ttl(),
                granted_s: r.granted_ttl(),
            })
        })
    }

    fn member_list(&self) -> BoxFut<'_, Result<Vec<ClusterMember>, KvError>> {
        Box::pin(async move {
            let r = self
                .call("member list", |c| {
                    let mut c = c.cluster_client();
                    async move { c.member_list().await }
                })
                .await?;
            Ok(r.members()
                .iter()
                .map(|m| ClusterMember {
                    id: m.id(),
                    name: m.name().to_owned(),
                    client_urls: m.client_urls().to_vec(),
                    peer_urls: m.peer_urls().to_vec(),
                    is_learner: m.is_learner(),
                })
                .collect())
        })
    }

    fn status(&self) -> BoxFut<'_, Result<ClusterStatus, KvError>> {
        Box::pin(async move {
            let r = self
                .call("status", |c| {
                    let mut m = c.maintenance_client();
                    async move { m.status().await }
                })
                .await?;
            let header = r.header();
            Ok(ClusterStatus {
                member_id: header.map_or(0, |h| h.member_id()),
                leader: r.leader(),
                version: r.version().to_owned(),
                db_size: r.db_size(),
                db_size_in_use: r.raft_used_db_size(),
                revision: header.map_or(0, |h| h.revision()),
                raft_term: header.map_or(r.raft_term(), |h| h.raft_term()),
                errors: r.errors().to_vec(),
            })
        })
    }

    fn alarms(&self) -> BoxFut<'_, Result<Vec<Alarm>, KvError>> {
        Box::pin(async move {
            let r = self
                .call("alarm list", |c| {
                    let mut m = c.maintenance_client();
                    async move { m.alarm(AlarmAction::Get, AlarmType::None, None).await }
                })
                .await?;
            Ok(r.alarms()
                .iter()
                .map(|a| Alarm {
                    member_id: a.member_id(),
                    kind: match a.alarm() {
                        AlarmType::Nospace => AlarmKind::NoSpace,
                        AlarmType::Corrupt => AlarmKind::Corrupt,
                        other => AlarmKind::Other(other as i32),
                    },
                })
                .filter(|a| a.kind != AlarmKind::Other(0))
                .collect())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: tonic::Code, msg: &str) -> etcd_client::Error {
        etcd_client::Error::GRpcStatus(tonic::Status::new(code, msg))
    }

    #[test]
    fn auth_refusals_are_auth_errors_that_say_what_to_fix() {
        let cases = [
            (
                tonic::Code::InvalidArgument,
                "etcdserver: authentication failed, invalid user ID or password",
                "check the user and password",
            ),
            (
                tonic::Code::InvalidArgument,
                "etcdserver: user name is empty",
                "needs a user",
            ),
            (
                tonic::Code::FailedPrecondition,
                "etcdserver: authentication is not enabled",
                "takes no user",
            ),
            (
                tonic::Code::PermissionDenied,
                "etcdserver: permission denied",
                "prefix",
            ),
        ];
        for (code, msg, hint) in cases {
            match map_err(status(code, msg)) {
                KvError::Auth(m) => assert!(m.contains(hint), "{msg}: {m}"),
                other => panic!("{msg}: {other:?}"),
            }
        }
        // A stale token is retried after a new login, not reported as refused credentials.
        let stale = status(
            tonic::Code::Unauthenticated,
            "etcdserver: invalid auth token",
        );
        assert!(is_stale_token(&stale));
        assert!(!is_stale_token(&status(
            tonic::Code::PermissionDenied,
            "etcdserver: permission denied"
        )));
        assert!(matches!(
            map_err(status(tonic::Code::Unavailable, "connection refused")),
            KvError::Unavailable(_)
        ));
    }

    /// An election's refusals are retried like an unreachable etcd, whatever gRPC code
    /// etcd gives them.
    #[test]
    fn election_refusals_are_unavailable() {
        for (code, msg) in [
            (tonic::Code::FailedPrecondition, "etcdserver: not leader"),
            (tonic::Code::Unavailable, "etcdserver: leader changed"),
            (tonic::Code::Unavailable, "etcdserver: no leader"),
            (tonic::Code::Unknown, "raft proposal dropped"),
            (tonic::Code::Unavailable, "etcdserver: proposal dropped"),
            (
                tonic::Code::ResourceExhausted,
                "etcdserver: too many requests",
            ),
            (tonic::Code::Unavailable, "etcdserver: request timed out"),
        ] {
            assert!(
                matches!(map_err(status(code, msg)), KvError::Unavailable(_)),
                "{msg}"
            );
        }
        assert!(matches!(
            map_err(status(
                tonic::Code::InvalidArgument,
                "etcdserver: duplicate key given in txn request"
            )),
            KvError::Invalid(_)
        ));
    }

    #[test]
    fn secrets_stay_out_of_debug() {
        let mut cfg = EtcdConfig::new(vec!["https://h:1".into()]);
        cfg.auth = Some(EtcdAuth::new("alice".into(), "hunter2-secret".into()));
        cfg.tls = Some(EtcdTls {
            ca_pem: b"CA".to_vec(),
            identity: Some((b"CERT".to_vec(), b"KEY-MATERIAL".to_vec())),
        });
        let shown = format!("{cfg:?}");
        assert!(shown.contains("alice"), "{shown}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("KEY-MATERIAL"),
            "{shown}"
        );
    }

    #[test]
    fn tls_hints() {
        let mut cfg = EtcdConfig::new(vec!["https://h:1".into()]);
        cfg.tls = Some(EtcdTls {
            ca_pem: Vec::new(),
            identity: None,
        });
        let e = |s: &str| KvError::Unavailable(s.into());
        assert!(tls_hint(&cfg, &e("received fatal alert: BadCertificate")).contains("--etcd-cert"));
        assert!(
            tls_hint(&cfg, &e("invalid peer certificate: UnknownIssuer"))
                .contains("--etcd-cacert signed")
        );
        assert_eq!(tls_hint(&cfg, &e("Connection refused (os error 111)")), "");
        let plain = EtcdConfig::new(vec!["http://h:1".into()]);
        assert!(tls_hint(&plain, &e("transport error: broken pipe")).contains("https://"));
    }
}
