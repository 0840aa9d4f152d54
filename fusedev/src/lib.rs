//! The FUSE protocol as kernel 6.18 (protocol 7.45) speaks it, and the two transports that
//! carry it: FUSE-over-io_uring (`transport::ring`) and classic `/dev/fuse` driven through
//! io_uring (`transport::devfuse`).
//!
//! The codec modules (`abi`, `opcode`, `request`, `reply`, `init`, `notify`) are pure:
//! bytes in, bytes out, no syscalls and no `unsafe`. Syscalls and `unsafe` live only in
//! `mount` and `transport`.

pub mod abi;
pub mod errno;
pub mod fuzz;
pub mod init;
pub mod mount;
pub mod names;
pub mod notify;
pub mod opcode;
pub mod reply;
pub mod request;
pub mod server;
pub mod transport;
