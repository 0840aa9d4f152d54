//! mount(8) and fstab: the mount helper's command line (`mount.etcfs`), the spec it is
//! given, and `-o` options.
//!
//! Options are parsed in one place, clap's `MountArgs`: an `-o` option is the long flag of
//! the same name without its dashes (`_` or `-` alike), so `-o device=/dev/sdb,perf`
//! becomes `--device=/dev/sdb --perf`, whichever flags `MountArgs` has. The flags are found
//! by asking clap's own definition of `etcfs mount`, so a new flag is an option at once,
//! and a misspelt one is refused by name. The generic options of mount(8) and fstab
//! (`ro`, `noatime`, `_netdev`, `nofail`, `x-systemd.*`...) are the one table here
//! ([`generic`]): each is turned into a flag, passed over (it is for mount(8) or
//! systemd), or refused with the reason.
//!
//! `etcfs mount -o OPTS` and `mount -t etcfs SPEC DIR -o OPTS` go through the same
//! translation ([`expand_argv`], [`helper_argv`]), and both end in one clap parse of
//! `etcfs mount` flags.

use std::{ffi::OsString, path::PathBuf};

/// The program name mount(8) runs for `-t etcfs` (from /sbin, /sbin/fs.d or /sbin/fs).
pub(crate) const HELPER_NAME: &str = "mount.etcfs";

/// Specs that mean the embedded default (a private etcd and a device image under
/// `--state-dir`): `etcfs` reads well in fstab's first column, `default` says what it is.
const DEFAULT_SPECS: [&str; 2] = ["etcfs", "default"];

const SPEC_HELP: &str = "\
SPEC is ETCD_URLS:/PREFIX: the etcd endpoints, comma-separated, then `:/` and the \
filesystem's etcd prefix, e.g. http://10.0.0.1:2379,http://10.0.0.2:2379:/fs1. The spec \
is split at its last `:/` not followed by another `/` (the `://` of a URL never is). \
Without `:/PREFIX` the prefix is `etcfs`. The spec `etcfs` or `default` mounts the \
embedded default (a private etcd and a device image under --state-dir).

OPTS are `etcfs mount` flags without their dashes (device=/dev/sdb,perf,cpus=\"0-3,6\"; \
double quotes keep commas in a value) and the generic options of mount(8): ro, rw, \
noatime, relatime, noexec, exec, nosuid, nodev, async, defaults, auto, noauto, _netdev, \
nofail, nouser, x-* (for systemd and other tools) are honoured or passed over; \
strictatime, suid, dev, sync, dirsync, user, users, owner, group and remount are refused \
with the reason, and so is any other unknown option (with -s, unknown options are only \
warned about).

Exit codes as mount(8) expects: 0 mounted (or checked, with -f), 1 bad invocation or \
options, 32 the mount failed.";

/// What mount(8) runs: `mount.etcfs SPEC DIR [-sfnv] [-N NS] [-o OPTS] [-t TYPE]`.
#[derive(clap::Parser, Debug)]
#[command(
    name = HELPER_NAME,
    version,
    about = "Mount an etcfs filesystem for mount(8) (`mount -t etcfs`, fstab)",
    after_help = SPEC_HELP
)]
pub(crate) struct HelperArgs {
    /// What to mount: ETCD_URLS:/PREFIX, or `etcfs` / `default` for the embedded default.
    pub(crate) spec: String,
    /// Directory to mount on.
    pub(crate) dir: PathBuf,
    /// Sloppy: warn about unknown options instead of refusing them.
    #[arg(short = 's')]
    pub(crate) sloppy: bool,
    /// Fake: check the spec and options, mount nothing.
    #[arg(short = 'f')]
    pub(crate) fake: bool,
    /// No mtab: accepted (etcfs keeps no mtab).
    #[arg(short = 'n')]
    pub(crate) no_mtab: bool,
    /// Verbose: print the `etcfs mount` command line it runs.
    #[arg(short = 'v')]
    pub(crate) verbose: bool,
    /// The mount namespace to mount in: a file such as /proc/PID/ns/mnt, or a PID.
    #[arg(short = 'N', value_name = "NS")]
    pub(crate) namespace: Option<String>,
    /// Mount options, comma-separated (see below).
    #[arg(short = 'o', value_name = "OPTS")]
    pub(crate) options: Vec<String>,
    /// The filesystem type mount(8) was given: `etcfs`.
    #[arg(short = 't', value_name = "TYPE")]
    pub(crate) fstype: Option<String>,
}

/// What a spec names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Spec {
    /// The embedded default.
    Default,
    /// A filesystem in an etcd cluster; `None`: the default prefix.
    Etcd {
        endpoints: Vec<String>,
        prefix: Option<String>,
    },
}

/// Parses a spec (see [`SPEC_HELP`]).
pub(crate) fn parse_spec(spec: &str) -> Result<Spec, String> {
    if DEFAULT_SPECS.contains(&spec) {
        return Ok(Spec::Default);
    }
    let split = spec
        .match_indices(":/")
        .map(|(i, _)| i)
        .filter(|&i| spec.as_bytes().get(i + 2) != Some(&b'/'))
        .last();
    let (urls, prefix) = match split {
        Some(i) => (&spec[..i], Some(&spec[i + 2..])),
        None => (spec, None),
    };
    if let Some(p) = prefix {
        meta::keys::Keyspace::new(p).map_err(|_| {
            format!(
                "spec {spec:?}: bad prefix {p:?} after `:/` (letters, digits, '.', '_' and '-')"
            )
        })?;
    }
    let endpoints: Vec<String> = urls.split(',').map(|u| u.trim().to_string()).collect();
    if let Some(bad) = endpoints.iter().find(|u| !is_endpoint(u)) {
        return Err(format!(
            "spec {spec:?}: {bad:?} is not an etcd endpoint; the spec is \
             ETCD_URLS:/PREFIX (e.g. http://10.0.0.1:2379:/fs1), or `etcfs` for the \
             embedded default"
        ));
    }
    Ok(Spec::Etcd {
        endpoints,
        prefix: prefix.map(str::to_string),
    })
}

/// An etcd endpoint: `http(s)://HOST[:PORT]` or `HOST:PORT`.
fn is_endpoint(u: &str) -> bool {
    let rest = u
        .strip_prefix("http://")
        .or_else(|| u.strip_prefix("https://"));
    match rest {
        Some(r) => !r.is_empty() && !r.contains('/'),
        None => u.contains(':') && !u.contains('/') && !u.starts_with(':'),
    }
}

/// Splits `a,b="x,y",c` at the commas outside double quotes, dropping the quotes.
pub(crate) fn split_options(s: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in s.chars() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    if quoted {
        return Err(format!("unbalanced double quote in options {s:?}"));
    }
    out.push(cur);
    Ok(out.into_iter().filter(|o| !o.is_empty()).collect())
}

/// What a generic option of mount(8) or fstab does here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Generic {
    /// For mount(8), systemd or the kernel's defaults that etcfs already has: nothing.
    Pass,
    /// Refused, with the reason.
    Refuse(&'static str),
    ReadOnly(bool),
    Atime(Atime),
    NoDiratime,
    NoExec(bool),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Atime {
    Relatime,
    Noatime,
}

/// The generic options, by name (`x-*` and `comment=` are handled before).
fn generic(name: &str) -> Option<Generic> {
    const SYNC: &str = "etcfs has no synchronous mode: writes of new blocks are written \
                        behind and reach etcd at fsync, close or within a second; fsync \
                        what must be durable";
    const USER: &str = "only root mounts etcfs (its daemon mounts FUSE itself, without \
                        fusermount); mount as root, or at boot from fstab";
    Some(match name {
        "defaults" | "auto" | "noauto" | "_netdev" | "nofail" | "nouser" | "async" | "diratime"
        | "nosuid" | "nodev" => Generic::Pass,
        "ro" => Generic::ReadOnly(true),
        "rw" => Generic::ReadOnly(false),
        "noatime" => Generic::Atime(Atime::Noatime),
        "relatime" | "atime" => Generic::Atime(Atime::Relatime),
        "nodiratime" => Generic::NoDiratime,
        "noexec" => Generic::NoExec(true),
        "exec" => Generic::NoExec(false),
        "strictatime" => Generic::Refuse(
            "etcfs keeps access times as relatime (the default) or not at all (noatime)",
        ),
        "suid" | "dev" => Generic::Refuse(
            "etcfs mounts are always nosuid,nodev: set-id bits and device files are \
             made by other nodes' root, not this node's",
        ),
        "sync" | "dirsync" => Generic::Refuse(SYNC),
        "user" | "users" | "owner" | "group" => Generic::Refuse(USER),
        "remount" => Generic::Refuse("remounting is not supported: umount, then mount again"),
        _ => return None,
    })
}

/// `-o` options turned into `etcfs mount` flags.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Translated {
    /// The flags, in the order given (`--name` or `--name=value`).
    pub(crate) args: Vec<String>,
    /// Options passed over (for mount(8), systemd, or unknown under `-s`).
    pub(crate) ignored: Vec<String>,
    /// Unknown options ignored because of `-s` (each worth a warning).
    pub(crate) unknown: Vec<String>,
}

/// Turns `-o` option strings into `etcfs mount` flags, checking each against `mount`
/// (clap's definition of `etcfs mount`). Of `ro`/`rw` and of the atime options the last
/// one given counts, as with mount(8). `sloppy` (`-s`) ignores unknown names; options
/// refused by name stay refused.
pub(crate) fn translate(
    options: &[String],
    mount: &clap::Command,
    sloppy: bool,
) -> Result<Translated, String> {
    let mut t = Translated::default();
    let (mut read_only, mut atime, mut noexec, mut nodiratime) = (None, None, None, false);
    for group in options {
        for opt in split_options(group)? {
            let (name, value) = match opt.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (opt.as_str(), None),
            };
            if name.starts_with("x-") || name == "comment" {
                t.ignored.push(opt.clone());
                continue;
            }
            if let Some(g) = generic(name) {
                if value.is_some() {
                    return Err(format!("mount option {name:?} takes no value"));
                }
                match g {
                    Generic::Pass => t.ignored.push(opt.clone()),
                    Generic::Refuse(why) => {
                        return Err(format!("mount option {name:?} is not supported: {why}"))
                    }
                    Generic::ReadOnly(v) => read_only = Some(v),
                    Generic::Atime(a) => atime = Some(a),
                    Generic::NoDiratime => nodiratime = true,
                    Generic::NoExec(v) => noexec = Some(v),
                }
                continue;
            }
            let Some(arg) = find_flag(mount, name) else {
                if sloppy {
                    t.unknown.push(opt.clone());
                    continue;
                }
                return Err(format!(
                    "unknown mount option {name:?}: the options are the flags of \
                     `etcfs mount` without their dashes (device=PATH, perf, cpus=LIST...) \
                     and the generic ones in `mount.etcfs --help`"
                ));
            };
            let long = arg.get_long().unwrap_or(name);
            let flag = match (arg.get_action().takes_values(), value) {
                (true, Some(v)) => format!("--{long}={v}"),
                (false, None) => format!("--{long}"),
                (true, None) => {
                    return Err(format!("mount option {name:?} needs a value ({name}=...)"))
                }
                (false, Some(_)) => return Err(format!("mount option {name:?} takes no value")),
            };
            // A switch given twice is given once (clap refuses repeats).
            if value.is_some() || !t.args.contains(&flag) {
                t.args.push(flag);
            }
        }
    }
    if nodiratime && atime != Some(Atime::Noatime) {
        return Err(
            "mount option \"nodiratime\" is supported only with noatime: etcfs \
                    keeps one access-time rule for files and directories"
                .into(),
        );
    }
    for (on, flag) in [
        (read_only == Some(true), "--read-only"),
        (atime == Some(Atime::Noatime), "--noatime"),
        (noexec == Some(true), "--noexec"),
    ] {
        if on && !t.args.iter().any(|a| a == flag) {
            t.args.push(flag.to_string());
        }
    }
    Ok(t)
}

/// The flag of `etcfs mount` an option names (`_` and `-` alike), if it is one an option
/// may set: a long flag, not help, version or `-o` itself.
fn find_flag<'a>(mount: &'a clap::Command, name: &str) -> Option<&'a clap::Arg> {
    let long = name.replace('_', "-");
    if long.is_empty() || matches!(long.as_str(), "help" | "version" | "options") {
        return None;
    }
    mount.get_arguments().find(|a| {
        a.get_long() == Some(long.as_str())
            || a.get_all_aliases()
                .is_some_and(|al| al.contains(&long.as_str()))
    })
}

/// `etcfs mount ... -o OPTS ...`: every `-o OPTS` (also `-oOPTS`, `--options OPTS`,
/// `--options=OPTS`) replaced by the flags it stands for, placed right after `mount` so
/// that a `--` before the mount point still ends the flags. Other command lines are
/// returned as they are. `cli` is clap's definition of the whole `etcfs` command.
pub(crate) fn expand_argv(
    argv: Vec<OsString>,
    cli: &clap::Command,
) -> Result<Vec<OsString>, String> {
    let Some(mount) = cli.find_subcommand("mount") else {
        return Ok(argv);
    };
    if argv.get(1).is_none_or(|a| a != "mount") {
        return Ok(argv);
    }
    let mut kept: Vec<OsString> = argv[..2].to_vec();
    let mut options = Vec::new();
    let mut rest = argv.into_iter().skip(2);
    while let Some(a) = rest.next() {
        let Some(s) = a.to_str() else {
            kept.push(a);
            continue;
        };
        if s == "--" {
            kept.push(a);
            kept.extend(rest.by_ref());
            break;
        }
        let value_of = |rest: &mut dyn Iterator<Item = OsString>| -> Result<String, String> {
            rest.next()
                .ok_or_else(|| "-o needs a value (comma-separated options)".to_string())?
                .into_string()
                .map_err(|_| "-o options must be UTF-8".to_string())
        };
        if s == "-o" || s == "--options" {
            options.push(value_of(&mut rest)?);
        } else if let Some(v) = s.strip_prefix("--options=") {
            options.push(v.to_string());
        } else if let Some((flags, v)) = short_cluster_with_o(s) {
            // `-oro`, or `-fo ro` / `-foro`: the flags before the `o` stay as they are.
            if flags.len() > 1 {
                kept.push(flags.into());
            }
            options.push(match v {
                "" => value_of(&mut rest)?,
                v => v.to_string(),
            });
        } else if let Some(long) = s.strip_prefix("--").filter(|l| !l.contains('=')) {
            // A flag whose value is the next word: that word is never an option.
            let takes = find_flag(mount, long).is_some_and(|f| f.get_action().takes_values());
            kept.push(a);
            if takes {
                kept.extend(rest.next());
            }
        } else {
            kept.push(a);
        }
    }
    if options.is_empty() {
        return Ok(kept);
    }
    let t = translate(&options, mount, false)?;
    let mut out: Vec<OsString> = kept[..2].to_vec();
    out.extend(t.args.into_iter().map(OsString::from));
    out.extend(kept.into_iter().skip(2));
    Ok(out)
}

/// A cluster of short flags holding `-o` (`-o...`, `-fo...`): the flags before the `o`
/// (with their dash) and what follows it in the word (empty: the value is the next word).
fn short_cluster_with_o(s: &str) -> Option<(&str, &str)> {
    let body = s.strip_prefix('-').filter(|b| !b.starts_with('-'))?;
    let at = body.find('o')?;
    if !body[..at].chars().all(|c| c.is_ascii_alphabetic()) {
        return None;
    }
    Some((&s[..at + 1], &body[at + 1..]))
}

/// The `etcfs mount` command line a helper invocation stands for (`argv[0]` is `etcfs`),
/// and the options it passed over. The mount point comes last, after `--`.
pub(crate) fn helper_argv(
    h: &HelperArgs,
    mount: &clap::Command,
) -> Result<(Vec<OsString>, Translated), String> {
    if let Some(t) = h.fstype.as_deref().filter(|t| *t != "etcfs") {
        return Err(format!(
            "{HELPER_NAME} mounts filesystems of type etcfs, not {t:?} (subtypes are not used)"
        ));
    }
    let spec = parse_spec(&h.spec)?;
    let t = translate(&h.options, mount, h.sloppy)?;
    let given = |flag: &str| {
        t.args
            .iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    if given("--etcd") || given("--prefix") {
        return Err("give the etcd endpoints and the prefix in the spec \
                    (ETCD_URLS:/PREFIX), not as options"
            .into());
    }
    let mut out: Vec<OsString> = vec!["etcfs".into(), "mount".into()];
    if let Spec::Etcd { endpoints, prefix } = &spec {
        out.push(format!("--etcd={}", endpoints.join(",")).into());
        if let Some(p) = prefix {
            out.push(format!("--prefix={p}").into());
        }
    }
    // The spec as the source in /proc/mounts, as fstab has it: mount(8) finds the line
    // mounted, and `mount -a` leaves it alone.
    if !given("--fsname") {
        out.push(format!("--fsname={}", h.spec).into());
    }
    out.extend(t.args.iter().map(OsString::from));
    out.push("--".into());
    out.push(h.dir.clone().into_os_string());
    Ok((out, t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory as _, Parser as _};

    fn mount_cmd() -> clap::Command {
        let mut cli = crate::Cli::command();
        cli.build();
        cli.find_subcommand("mount").unwrap().clone()
    }

    fn tr(opts: &str) -> Result<Vec<String>, String> {
        translate(&[opts.to_string()], &mount_cmd(), false).map(|t| t.args)
    }

    fn etcd(urls: &[&str], prefix: Option<&str>) -> Spec {
        Spec::Etcd {
            endpoints: urls.iter().map(|u| u.to_string()).collect(),
            prefix: prefix.map(str::to_string),
        }
    }

    #[test]
    fn spec_splits_at_the_last_colon_slash_not_of_a_url() {
        assert_eq!(
            parse_spec("http://127.0.0.1:2379:/fsname"),
            Ok(etcd(&["http://127.0.0.1:2379"], Some("fsname")))
        );
        assert_eq!(
            parse_spec("http://a:2379,https://b:2379:/fs-1.x_y"),
            Ok(etcd(&["http://a:2379", "https://b:2379"], Some("fs-1.x_y")))
        );
        assert_eq!(
            parse_spec("http://a:2379,http://b:2379"),
            Ok(etcd(&["http://a:2379", "http://b:2379"], None))
        );
        assert_eq!(
            parse_spec("10.0.0.1:2379,10.0.0.2:2379:/fs"),
            Ok(etcd(&["10.0.0.1:2379", "10.0.0.2:2379"], Some("fs")))
        );
        assert_eq!(parse_spec("etcfs"), Ok(Spec::Default));
        assert_eq!(parse_spec("default"), Ok(Spec::Default));
    }

    #[test]
    fn spec_errors_say_what_is_wrong() {
        for bad in [
            "http://a:2379:/",
            "http://a:2379:/a/b",
            "/dev/sdb",
            "",
            "http://a:2379,,http://b:2379:/x",
            "http://:/x",
            "none",
        ] {
            let e = parse_spec(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
        assert!(parse_spec("http://a:2379:/bad prefix")
            .unwrap_err()
            .contains("bad prefix"));
    }

    #[test]
    fn options_become_flags_of_the_same_name() {
        assert_eq!(
            tr("device=/dev/sdb,perf,lock_min_hold_ms=5,ring-share-above=0").unwrap(),
            [
                "--device=/dev/sdb",
                "--perf",
                "--lock-min-hold-ms=5",
                "--ring-share-above=0"
            ]
        );
        // Quotes keep a comma inside a value; an empty item is nothing.
        assert_eq!(
            tr("cpus=\"0-3,6\",,etcd_cacert=/a b").unwrap(),
            ["--cpus=0-3,6", "--etcd-cacert=/a b"]
        );
        // A visible alias is a name too.
        assert_eq!(tr("read_only").unwrap(), ["--read-only"]);
    }

    #[test]
    fn generic_options_are_honoured_passed_over_or_refused() {
        assert_eq!(
            tr(
                "defaults,_netdev,nofail,auto,noauto,nouser,x-systemd.requires=etcd.service,\
                x-systemd.mount-timeout=90,comment=x,nosuid,nodev,async,exec"
            )
            .unwrap(),
            Vec::<String>::new()
        );
        assert_eq!(
            tr("ro,noatime,noexec").unwrap(),
            ["--read-only", "--noatime", "--noexec"]
        );
        // The last of ro/rw and of the atime options counts, as for mount(8).
        assert_eq!(tr("ro,rw,noatime,relatime").unwrap(), Vec::<String>::new());
        assert_eq!(tr("rw,ro").unwrap(), ["--read-only"]);
        assert_eq!(tr("ro,ro,read-only").unwrap(), ["--read-only"]);
        assert_eq!(tr("noatime,nodiratime").unwrap(), ["--noatime"]);
        for (opt, says) in [
            ("strictatime", "relatime"),
            ("suid", "nosuid"),
            ("dev", "nosuid,nodev"),
            ("sync", "fsync"),
            ("dirsync", "fsync"),
            ("user", "root"),
            ("users", "root"),
            ("owner", "root"),
            ("remount", "umount"),
            ("nodiratime", "noatime"),
            ("ro=1", "no value"),
        ] {
            let e = tr(opt).unwrap_err();
            assert!(e.contains(says), "{opt}: {e}");
        }
    }

    #[test]
    fn unknown_and_misused_options_are_refused_by_name() {
        for (opt, says) in [
            ("bogus", "unknown mount option \"bogus\""),
            ("bogus=1", "unknown mount option \"bogus\""),
            ("help", "unknown mount option \"help\""),
            ("version", "unknown mount option \"version\""),
            ("options=ro", "unknown mount option \"options\""),
            ("mountpoint=/x", "unknown mount option \"mountpoint\""),
            ("device", "needs a value"),
            ("perf=1", "takes no value"),
            ("a=\"b", "unbalanced"),
        ] {
            let e = tr(opt).unwrap_err();
            assert!(e.contains(says), "{opt}: {e}");
        }
        // -s: unknown names are ignored (and reported), refused ones stay refused.
        let t = translate(&["bogus,perf,x=1".into()], &mount_cmd(), true).unwrap();
        assert_eq!(t.args, ["--perf"]);
        assert_eq!(t.unknown, ["bogus", "x=1"]);
        assert!(translate(&["sync".into()], &mount_cmd(), true).is_err());
    }

    #[test]
    fn every_flag_of_etcfs_mount_is_an_option() {
        let m = mount_cmd();
        for arg in m.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if matches!(long, "help" | "version" | "options") {
                continue;
            }
            let opt = if arg.get_action().takes_values() {
                format!("{}=v", long.replace('-', "_"))
            } else {
                long.to_string()
            };
            // Generic names (noatime, noexec) translate to their own flag too.
            let args = tr(&opt).unwrap_or_else(|e| panic!("{opt}: {e}"));
            assert_eq!(args.len(), 1, "{opt}: {args:?}");
            assert!(args[0].starts_with(&format!("--{long}")), "{opt}: {args:?}");
        }
    }

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn etcfs_mount_dash_o_expands_in_place() {
        let cli = crate::Cli::command();
        let got = expand_argv(
            os(&[
                "etcfs",
                "mount",
                "--log-file",
                "-o",
                "-o",
                "ro,perf",
                "/mnt",
                "-odevice=/d",
            ]),
            &cli,
        )
        .unwrap();
        assert_eq!(
            got,
            os(&[
                "etcfs",
                "mount",
                "--perf",
                "--device=/d",
                "--read-only",
                "--log-file",
                "-o",
                "/mnt"
            ])
        );
        // After `--` nothing is an option; other commands are left alone.
        let argv = os(&["etcfs", "mount", "--", "-o"]);
        assert_eq!(expand_argv(argv.clone(), &cli).unwrap(), argv);
        let argv = os(&["etcfs", "stats", "-o", "x"]);
        assert_eq!(expand_argv(argv.clone(), &cli).unwrap(), argv);
        assert!(
            expand_argv(os(&["etcfs", "mount", "/m", "-o", "bogus"]), &cli)
                .unwrap_err()
                .contains("bogus")
        );
        assert!(expand_argv(os(&["etcfs", "mount", "/m", "-o"]), &cli).is_err());
        // -o inside a cluster of short flags.
        assert_eq!(
            expand_argv(os(&["etcfs", "mount", "-fo", "ro", "/m"]), &cli).unwrap(),
            os(&["etcfs", "mount", "--read-only", "-f", "/m"])
        );
        assert_eq!(
            expand_argv(os(&["etcfs", "mount", "-fonoatime", "/m"]), &cli).unwrap(),
            os(&["etcfs", "mount", "--noatime", "-f", "/m"])
        );
        // The expansion parses as `etcfs mount` flags.
        let argv = expand_argv(
            os(&["etcfs", "mount", "--options=noatime,ro", "--memfs", "/m"]),
            &cli,
        )
        .unwrap();
        let crate::Command::Mount(m) = crate::Cli::try_parse_from(argv).unwrap().command else {
            panic!("not mount")
        };
        assert!(m.read_only && m.noatime && m.memfs);
    }

    #[test]
    fn helper_command_line_as_mount_8_passes_it() {
        let h = HelperArgs::try_parse_from([
            "/sbin/mount.etcfs",
            "http://127.0.0.1:2379:/fsname",
            "/mnt/x",
            "-s",
            "-n",
            "-v",
            "-o",
            "ro,noatime,noexec,nosuid,nodev,device=/path/img,_netdev,nofail,bogus",
            "-N",
            "/proc/1/fd/4",
        ])
        .unwrap();
        assert!(h.sloppy && h.no_mtab && h.verbose && !h.fake);
        assert_eq!(h.namespace.as_deref(), Some("/proc/1/fd/4"));
        let (argv, t) = helper_argv(&h, &mount_cmd()).unwrap();
        assert_eq!(
            argv,
            os(&[
                "etcfs",
                "mount",
                "--etcd=http://127.0.0.1:2379",
                "--prefix=fsname",
                "--fsname=http://127.0.0.1:2379:/fsname",
                "--device=/path/img",
                "--read-only",
                "--noatime",
                "--noexec",
                "--",
                "/mnt/x",
            ])
        );
        assert_eq!(t.unknown, ["bogus"]);
        let crate::Command::Mount(m) = crate::Cli::try_parse_from(argv).unwrap().command else {
            panic!("not mount")
        };
        assert!(m.read_only && m.noatime && m.noexec);
        assert_eq!(m.store.etcd, ["http://127.0.0.1:2379"]);
        assert_eq!(m.store.prefix, "fsname");
        assert_eq!(m.mountpoint, PathBuf::from("/mnt/x"));

        // Combined short flags, the embedded default, a spec-less prefix.
        let h = HelperArgs::try_parse_from(["mount.etcfs", "etcfs", "/m", "-sfv", "-oro"]).unwrap();
        assert!(h.sloppy && h.fake && h.verbose);
        let (argv, _) = helper_argv(&h, &mount_cmd()).unwrap();
        assert_eq!(
            argv,
            os(&[
                "etcfs",
                "mount",
                "--fsname=etcfs",
                "--read-only",
                "--",
                "/m"
            ])
        );
    }

    #[test]
    fn helper_refuses_what_it_cannot_mount() {
        let run = |args: &[&str]| {
            let h = HelperArgs::try_parse_from(args).unwrap();
            helper_argv(&h, &mount_cmd()).unwrap_err()
        };
        assert!(run(&["m", "etcfs", "/m", "-t", "etcfs.sub"]).contains("etcfs.sub"));
        assert!(run(&["m", "http://a:1:/p", "/m", "-o", "etcd=http://b:1"]).contains("spec"));
        assert!(run(&["m", "http://a:1:/p", "/m", "-o", "prefix=q"]).contains("spec"));
        assert!(run(&["m", "http://a:1:/p", "/m", "-o", "bogus"]).contains("\"bogus\""));
        assert!(run(&["m", "/dev/sdb", "/m"]).contains("not an etcd endpoint"));
        // -t etcfs is fine.
        let h = HelperArgs::try_parse_from(["m", "etcfs", "/m", "-t", "etcfs"]).unwrap();
        assert!(helper_argv(&h, &mount_cmd()).is_ok());
    }
}
