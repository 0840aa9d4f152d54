//! [`Errno`]: the error a FUSE reply carries. Never zero (zero is success), positive in
//! memory, negated only when it is written into an out header.

#![forbid(unsafe_code)]
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

use std::{fmt, io, num::NonZeroI32};

/// A positive errno value (`libc::E*`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Errno(NonZeroI32);

/// `NonZeroI32::new` in const context without a panic path: libc errno constants are never
/// zero (the table test below checks every constant against its libc value).
const fn nz(raw: i32) -> NonZeroI32 {
    match NonZeroI32::new(raw) {
        Some(v) => v,
        None => NonZeroI32::MIN,
    }
}

/// Declares the constants and the name table from one list.
macro_rules! errnos {
    ($( $name:ident ),* $(,)?) => {
        impl Errno {
            $( pub const $name: Errno = Errno(nz(libc::$name)); )*
        }

        /// Every named constant with its name, for `Display` and the table test.
        const NAMED: &[(Errno, &str)] = &[ $( (Errno::$name, stringify!($name)), )* ];
    };
}

errnos!(
    EPERM,
    ENOENT,
    EINTR,
    EIO,
    ENXIO,
    E2BIG,
    EBADF,
    EAGAIN,
    ENOMEM,
    EACCES,
    EFAULT,
    EBUSY,
    EEXIST,
    EXDEV,
    ENODEV,
    ENOTDIR,
    EISDIR,
    EINVAL,
    ENFILE,
    EMFILE,
    ETXTBSY,
    EFBIG,
    ENOSPC,
    ESPIPE,
    EROFS,
    EMLINK,
    ERANGE,
    EDEADLK,
    ENAMETOOLONG,
    ENOLCK,
    ENOSYS,
    ENOTEMPTY,
    ELOOP,
    ENODATA,
    EOVERFLOW,
    EPROTO,
    EOPNOTSUPP,
    ECONNABORTED,
    ENOTCONN,
    ETIMEDOUT,
    ESTALE,
    EDQUOT,
    ECANCELED,
);

impl Errno {
    /// `None` for 0 (success); any other value is accepted as is.
    pub const fn from_raw(raw: i32) -> Option<Errno> {
        match NonZeroI32::new(raw) {
            Some(v) => Some(Errno(v)),
            None => None,
        }
    }

    /// The positive errno value.
    pub const fn raw(self) -> i32 {
        self.0.get()
    }

    /// The value for `OutHeader::error`: the negated errno.
    pub const fn wire(self) -> i32 {
        self.0.get().wrapping_neg()
    }

    /// The constant's name (`"ENOENT"`), if it is one of the named constants.
    pub fn name(self) -> Option<&'static str> {
        NAMED.iter().find(|(e, _)| *e == self).map(|(_, n)| *n)
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({})", self.raw()),
            None => write!(f, "errno {}", self.raw()),
        }
    }
}

impl std::error::Error for Errno {}

impl From<io::Error> for Errno {
    /// The OS error inside, or EIO for errors that did not come from the OS.
    fn from(e: io::Error) -> Errno {
        e.raw_os_error()
            .filter(|&raw| raw > 0)
            .and_then(Errno::from_raw)
            .unwrap_or(Errno::EIO)
    }
}

impl From<Errno> for io::Error {
    fn from(e: Errno) -> io::Error {
        io::Error::from_raw_os_error(e.raw())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

    use super::*;

    #[test]
    fn constants_match_libc() {
        assert_eq!(Errno::ENOENT.raw(), libc::ENOENT);
        assert_eq!(Errno::ENOTEMPTY.raw(), libc::ENOTEMPTY);
        assert_eq!(Errno::EOPNOTSUPP.raw(), libc::EOPNOTSUPP);
        for (e, name) in NAMED {
            assert!(e.raw() > 0, "{name}");
            assert_eq!(e.name(), Some(*name));
        }
    }

    #[test]
    fn raw_wire_and_display() {
        assert_eq!(Errno::from_raw(0), None);
        assert_eq!(Errno::from_raw(libc::EIO), Some(Errno::EIO));
        assert_eq!(Errno::ENOENT.wire(), -libc::ENOENT);
        assert_eq!(
            Errno::ENOENT.to_string(),
            format!("ENOENT ({})", libc::ENOENT)
        );
        assert_eq!(
            Errno::from_raw(4000).map(|e| e.to_string()),
            Some("errno 4000".into())
        );
    }

    #[test]
    fn io_error_conversion() {
        let e = io::Error::from_raw_os_error(libc::ENOSPC);
        assert_eq!(Errno::from(e), Errno::ENOSPC);
        assert_eq!(Errno::from(io::Error::other("not an os error")), Errno::EIO);
        assert_eq!(
            io::Error::from(Errno::EEXIST).raw_os_error(),
            Some(libc::EEXIST)
        );
    }
}
