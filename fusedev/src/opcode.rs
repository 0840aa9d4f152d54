//! FUSE opcodes: a checked conversion from the wire value (never a transmute: the value
//! range has holes), names for logs, and a dense index for per-opcode counters.

#![forbid(unsafe_code)]
#![deny(clippy::indexing_slicing, clippy::unwrap_used, clippy::panic)]

use std::fmt;

/// Defines [`Opcode`] with its wire values and names from one list, so the enum, the
/// conversion, the names and the dense index cannot drift apart.
macro_rules! opcodes {
    ($( $variant:ident = $value:literal => $name:literal, )*) => {
        /// A FUSE request opcode (`enum fuse_opcode`), as of protocol 7.45.
        #[repr(u32)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Opcode {
            $( $variant = $value, )*
        }

        impl Opcode {
            /// Every opcode, in wire-value order; `ALL[i].index() == i`.
            pub const ALL: [Opcode; Opcode::KNOWN] = [ $( Opcode::$variant, )* ];

            /// Counter names indexed by [`Opcode::index`], the last one being `"UNKNOWN"`.
            pub const NAMES: [&'static str; Opcode::COUNT] = [ $( $name, )* "UNKNOWN" ];

            /// The kernel's name without the `FUSE_` prefix, e.g. `"LOOKUP"`.
            pub const fn name(self) -> &'static str {
                match self {
                    $( Opcode::$variant => $name, )*
                }
            }
        }

        impl TryFrom<u32> for Opcode {
            type Error = UnknownOpcode;

            fn try_from(value: u32) -> Result<Self, UnknownOpcode> {
                match value {
                    $( $value => Ok(Opcode::$variant), )*
                    _ => Err(UnknownOpcode(value)),
                }
            }
        }
    };
}

opcodes! {
    Lookup = 1 => "LOOKUP",
    Forget = 2 => "FORGET",
    Getattr = 3 => "GETATTR",
    Setattr = 4 => "SETATTR",
    Readlink = 5 => "READLINK",
    Symlink = 6 => "SYMLINK",
    Mknod = 8 => "MKNOD",
    Mkdir = 9 => "MKDIR",
    Unlink = 10 => "UNLINK",
    Rmdir = 11 => "RMDIR",
    Rename = 12 => "RENAME",
    Link = 13 => "LINK",
    Open = 14 => "OPEN",
    Read = 15 => "READ",
    Write = 16 => "WRITE",
    Statfs = 17 => "STATFS",
    Release = 18 => "RELEASE",
    Fsync = 20 => "FSYNC",
    Setxattr = 21 => "SETXATTR",
    Getxattr = 22 => "GETXATTR",
    Listxattr = 23 => "LISTXATTR",
    Removexattr = 24 => "REMOVEXATTR",
    Flush = 25 => "FLUSH",
    Init = 26 => "INIT",
    Opendir = 27 => "OPENDIR",
    Readdir = 28 => "READDIR",
    Releasedir = 29 => "RELEASEDIR",
    Fsyncdir = 30 => "FSYNCDIR",
    Getlk = 31 => "GETLK",
    Setlk = 32 => "SETLK",
    Setlkw = 33 => "SETLKW",
    Access = 34 => "ACCESS",
    Create = 35 => "CREATE",
    Interrupt = 36 => "INTERRUPT",
    Bmap = 37 => "BMAP",
    Destroy = 38 => "DESTROY",
    Ioctl = 39 => "IOCTL",
    Poll = 40 => "POLL",
    NotifyReply = 41 => "NOTIFY_REPLY",
    BatchForget = 42 => "BATCH_FORGET",
    Fallocate = 43 => "FALLOCATE",
    Readdirplus = 44 => "READDIRPLUS",
    Rename2 = 45 => "RENAME2",
    Lseek = 46 => "LSEEK",
    CopyFileRange = 47 => "COPY_FILE_RANGE",
    SetupMapping = 48 => "SETUPMAPPING",
    RemoveMapping = 49 => "REMOVEMAPPING",
    Syncfs = 50 => "SYNCFS",
    Tmpfile = 51 => "TMPFILE",
    Statx = 52 => "STATX",
    CopyFileRange64 = 53 => "COPY_FILE_RANGE_64",
}

/// Largest wire value in [`Opcode`].
const RAW_MAX: usize = 53;

/// Dense index by wire value, built at compile time; holes map to the UNKNOWN slot.
#[allow(clippy::indexing_slicing)] // evaluated at compile time: out of bounds fails the build
const INDEX_BY_RAW: [u8; RAW_MAX + 1] = {
    let mut table = [Opcode::UNKNOWN_INDEX as u8; RAW_MAX + 1];
    let mut i = 0;
    while i < Opcode::ALL.len() {
        table[Opcode::ALL[i] as usize] = i as u8;
        i += 1;
    }
    table
};
const _: () = assert!(Opcode::COUNT <= u8::MAX as usize);

impl Opcode {
    /// Number of known opcodes.
    pub const KNOWN: usize = 51;
    /// Size of the dense index space: every known opcode plus one UNKNOWN slot.
    pub const COUNT: usize = Opcode::KNOWN + 1;
    /// The slot [`Opcode::index_of_raw`] gives values that are not an [`Opcode`].
    pub const UNKNOWN_INDEX: usize = Opcode::KNOWN;

    /// The wire value.
    pub const fn raw(self) -> u32 {
        self as u32
    }

    /// Position in `0..Opcode::KNOWN`, for arrays of per-opcode counters.
    pub fn index(self) -> usize {
        Opcode::index_of_raw(self.raw())
    }

    /// Like [`Opcode::index`], for a raw header value: unknown values get
    /// [`Opcode::UNKNOWN_INDEX`].
    pub fn index_of_raw(raw: u32) -> usize {
        usize::try_from(raw)
            .ok()
            .and_then(|r| INDEX_BY_RAW.get(r))
            .map_or(Opcode::UNKNOWN_INDEX, |&i| usize::from(i))
    }

    /// Name of a raw header value, `"UNKNOWN"` for values that are not an [`Opcode`].
    pub fn name_of_raw(raw: u32) -> &'static str {
        Opcode::try_from(raw).map_or("UNKNOWN", Opcode::name)
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A header opcode that is not in [`Opcode`] (CUSE_INIT, or newer than protocol 7.45).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownOpcode(pub u32);

impl fmt::Display for UnknownOpcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown FUSE opcode {}", self.0)
    }
}

impl std::error::Error for UnknownOpcode {}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

    use super::*;

    #[test]
    fn conversion_round_trips_and_index_is_dense() {
        for (i, op) in Opcode::ALL.iter().enumerate() {
            assert_eq!(Opcode::try_from(op.raw()), Ok(*op));
            assert_eq!(op.index(), i);
            assert_eq!(Opcode::NAMES[i], op.name());
        }
        assert_eq!(Opcode::ALL.len(), Opcode::KNOWN);
        assert_eq!(Opcode::NAMES[Opcode::UNKNOWN_INDEX], "UNKNOWN");
    }

    #[test]
    fn holes_and_out_of_range_values_are_unknown() {
        for raw in [0, 7, 19, 54, 4096, u32::MAX] {
            assert_eq!(Opcode::try_from(raw), Err(UnknownOpcode(raw)));
            assert_eq!(Opcode::index_of_raw(raw), Opcode::UNKNOWN_INDEX);
            assert_eq!(Opcode::name_of_raw(raw), "UNKNOWN");
        }
        assert_eq!(Opcode::index_of_raw(1), Opcode::Lookup.index());
    }

    #[test]
    fn names_are_unique() {
        let mut names = Opcode::NAMES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Opcode::COUNT);
    }
}
