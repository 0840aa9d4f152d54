//! etcfs-meta: the etcd layer of etcfs (docs to be expanded with the pipeline).
#![forbid(unsafe_code)]

pub mod clock;
pub mod codec;
pub mod conformance;
pub mod error;
pub mod etcd;
pub mod format;
pub mod keys;
pub mod kv;
pub mod model;
pub mod pipeline;
pub mod reader;
pub mod session;
pub mod types;
