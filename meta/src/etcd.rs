//! The real backend: etcd v3 through `etcd-client`.
//!
//! Every call is bounded by `request_timeout` and connecting is bounded by
//! `connect_timeout` plus one probe request, because `etcd-client` connects lazily: an
//! unreachable endpoint would otherwise surface only as a hang on the first request.

use std::time::Duration;

use etcd_client::{
    AlarmAction, AlarmType, Client, Compare as EcCompare, CompareOp as EcOp, ConnectOptions,
    DeleteOptions, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn as EcTxn,
    TxnOp as EcTxnOp, TxnOpResponse as EcResp, WatchOptions,
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
    /// Endpoint URLs (`http://host:port`).
    pub endpoints: Vec<String>,
    /// Bound on establishing the connection (and the probe request).
    pub connect_timeout: Duration,
    /// Bound on every request.
    pub request_timeout: Duration,
}

impl EtcdConfig {
    /// Defaults: 4 s to connect and answer a probe, 5 s per request.
    pub fn new(endpoints: Vec<String>) -> Self {
        EtcdConfig {
            endpoints,
            connect_timeout: Duration::from_secs(4),
            request_timeout: Duration::from_secs(5),
        }
    }
}

/// A connected etcd backend.
#[derive(Clone)]
pub struct EtcdBackend {
    client: Client,
    request_timeout: Duration,
}

impl std::fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend").finish_non_exhaustive()
    }
}

fn map_err(e: etcd_client::Error) -> KvError {
    use etcd_client::Error as E;
    match e {
        E::GRpcStatus(s) => {
            let msg = s.message().to_owned();
            if msg.contains("too many operations") {
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
        E::TransportError(t) => KvError::Unavailable(t.to_string()),
        E::IoError(io) => KvError::Unavailable(io.to_string()),
        E::LeaseKeepAliveError(m) if m.contains("lease not found") => KvError::LeaseNotFound,
        other => KvError::Other(other.to_string()),
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

impl EtcdBackend {
    /// Connects and probes the cluster; an unreachable or silent cluster is an
    /// `Unavailable` error within `connect_timeout`, never a hang.
    pub async fn connect(cfg: &EtcdConfig) -> Result<Self, KvError> {
        if cfg.endpoints.is_empty() {
            return Err(KvError::Invalid("no etcd endpoints".into()));
        }
        let eps = &cfg.endpoints;
        match tokio::time::timeout(cfg.connect_timeout, Self::connect_and_probe(cfg)).await {
            Ok(Ok(b)) => Ok(b),
            Ok(Err(e)) => Err(KvError::Unavailable(format!("etcd at {eps:?}: {e}"))),
            Err(_) => Err(KvError::Unavailable(format!(
                "etcd at {eps:?} did not answer within {:?}",
                cfg.connect_timeout
            ))),
        }
    }

    async fn connect_and_probe(cfg: &EtcdConfig) -> Result<Self, KvError> {
        let opts = ConnectOptions::new()
            .with_connect_timeout(cfg.connect_timeout)
            .with_timeout(cfg.request_timeout)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        let client = Client::connect(cfg.endpoints.clone(), Some(opts))
            .await
            .map_err(map_err)?;
        let backend = EtcdBackend {
            client,
            request_timeout: cfg.request_timeout,
        };
        // Probe: a bounded read proves the cluster answers (and has a leader for
        // linearizable reads) before the daemon commits to using it.
        let probe = RangeRequest::key(b"\0etcfs-probe".to_vec())
            .limit(1)
            .keys_only();
        backend.range(probe).await?;
        Ok(backend)
    }
}

impl KvBackend for EtcdBackend {
    fn range(&self, req: RangeRequest) -> BoxFut<'_, Result<RangeResponse, KvError>> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let resp = bounded(
                self.request_timeout,
                "range",
                kv.get(req.key.clone(), Some(get_options(&req))),
            )
            .await?;
            Ok(range_from(&resp))
        })
    }

    fn txn(&self, txn: Txn) -> BoxFut<'_, Result<TxnResponse, KvError>> {
        Box::pin(async move {
            let t = EcTxn::new()
                .when(txn.compares.iter().map(compare_to).collect::<Vec<_>>())
                .and_then(txn.success.iter().map(op_to).collect::<Vec<_>>())
                .or_else(txn.failure.iter().map(op_to).collect::<Vec<_>>());
            let mut kv = self.client.kv_client();
            let resp = bounded(self.request_timeout, "txn", kv.txn(t)).await?;
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
            let mut l = self.client.lease_client();
            let r = bounded(self.request_timeout, "lease grant", l.grant(ttl_s, None)).await?;
            Ok(LeaseGrant {
                id: r.id(),
                ttl_s: r.ttl(),
            })
        })
    }

    fn lease_keepalive(&self, id: i64) -> BoxFut<'_, Result<i64, KvError>> {
        Box::pin(async move {
            let mut l = self.client.lease_client();
            let ttl = bounded(self.request_timeout, "lease keepalive", async move {
                let (mut keeper, mut stream) = l.keep_alive(id).await?;
                keeper.keep_alive().await?;
                let msg = stream.message().await?;
                Ok(msg.map_or(0, |m| m.ttl()))
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
            let mut l = self.client.lease_client();
            bounded(self.request_timeout, "lease revoke", l.revoke(id)).await?;
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
            let mut w = self.client.watch_client();
            let mut opts = WatchOptions::new().with_range(range_end);
            if start_revision > 0 {
                opts = opts.with_start_revision(start_revision);
            }
            let (mut watcher, mut stream) =
                bounded(self.request_timeout, "watch", w.watch(key, Some(opts))).await?;
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
            let mut l = self.client.lease_client();
            let r = bounded(
                self.request_timeout,
                "lease time-to-live",
                l.time_to_live(id, None),
            )
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
            let mut c = self.client.cluster_client();
            let r = bounded(self.request_timeout, "member list", c.member_list()).await?;
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
            let mut m = self.client.maintenance_client();
            let r = bounded(self.request_timeout, "status", m.status()).await?;
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
            let mut m = self.client.maintenance_client();
            let r = bounded(
                self.request_timeout,
                "alarm list",
                m.alarm(AlarmAction::Get, AlarmType::None, None),
            )
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
