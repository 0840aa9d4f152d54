//! Permissions as users other than root (issue 15): sticky and set-group-id directories,
//! the umask, chown rules, POSIX ACLs (deny and grant entries, the mask, default ACLs
//! inherited by files and directories), xattr namespaces, `statfs` inode counts and atime
//! under relatime. Every expectation is what ext4 answers on this kernel: each was run
//! on an ext4 image (`mkfs.ext4` on a file, `mount -o loop`) and hard-coded here; a
//! comment says so where ext4's answer is not the obvious one.
//!
//! One etcfs mount with `--allow-other` (the daemon mounts with `default_permissions`
//! always); the calls are made by the syscall helper (tests/common) under `setpriv` with
//! numeric ids, so no users need to exist. Needs root, `/dev/fuse`, `ETCD_ENDPOINTS`,
//! `setpriv`, `setfacl` and `getfacl`; skips loudly otherwise (fails with
//! `ETCFS_REQUIRE_MOUNT_TESTS=1`).

mod common;

use std::{
    fs,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use common::{helper_path, run_bounded, Daemon, TestFs};

const ALICE: u32 = 1000;
const BOB: u32 = 1001;
/// A group neither user is in unless given it.
const STAFF: u32 = 2000;

/// The mount and a copy of the syscall helper every user can run.
struct Env {
    _fs: TestFs,
    m: Daemon,
    bin: PathBuf,
}

fn tools_or_skip(test: &str) -> bool {
    for tool in ["setpriv", "setfacl", "getfacl"] {
        let found = Command::new(tool).arg("--version").output().is_ok();
        if !found {
            let why = format!("`{tool}` is not installed (apt-get install util-linux acl)");
            assert!(!common::mount_tests_required(), "{test}: {why}");
            common::loud(&format!("SKIP {test}: {why}"));
            return false;
        }
    }
    true
}

fn setup(test: &str, extra: &[&str]) -> Option<Env> {
    if !tools_or_skip(test) {
        return None;
    }
    let fs = TestFs::new_or_skip(test, None)?;
    let mut args = vec!["--allow-other"];
    args.extend_from_slice(extra);
    let m = fs.mount("auto", &args);
    let bin = fs.base.join("helper");
    fs::copy(helper_path(), &bin).expect("copy helper");
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).expect("chmod helper");
    fs::set_permissions(&m.mnt, fs::Permissions::from_mode(0o755)).expect("chmod root");
    Some(Env { _fs: fs, m, bin })
}

impl Env {
    fn p(&self, name: &str) -> String {
        self.m.path(name).to_string_lossy().into_owned()
    }

    /// The helper as `uid` with primary group `uid` and supplementary `groups`, under
    /// `umask`: `Ok(output)` or `Err(errno)`.
    fn run_as(&self, uid: u32, groups: &[u32], umask: u32, args: &[&str]) -> Result<String, i32> {
        let groups = if groups.is_empty() {
            "--clear-groups".to_string()
        } else {
            let g: Vec<String> = groups.iter().map(u32::to_string).collect();
            format!("--groups={}", g.join(","))
        };
        let script = format!("umask {umask:03o}; exec \"$0\" \"$@\"");
        let (out, in_time) = run_bounded(
            Command::new("setpriv")
                .arg(format!("--reuid={uid}"))
                .arg(format!("--regid={uid}"))
                .arg(&groups)
                .args(["--", "sh", "-c", &script])
                .arg(&self.bin)
                .args(args),
            Duration::from_secs(30),
        );
        assert!(in_time, "helper as {uid} {args:?} hung");
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.trim_end_matches('\n');
        if let Some(e) = line.strip_prefix("E ") {
            return Err(e.trim().parse().expect("errno"));
        }
        match line.strip_prefix('0') {
            Some(rest) => Ok(rest.trim_start().to_string()),
            None => panic!(
                "helper as {uid} {args:?}: {text:?} (stderr {})",
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    }

    fn as_user(&self, uid: u32, args: &[&str]) -> Result<String, i32> {
        self.run_as(uid, &[], 0o022, args)
    }

    fn read_as(&self, uid: u32, name: &str) -> Result<String, i32> {
        self.as_user(uid, &["open", &self.p(name), "r"])
    }

    fn write(&self, name: &str, mode: u32) {
        fs::write(self.m.path(name), b"root's\n").expect("create");
        self.chmod(name, mode);
    }

    fn chmod(&self, name: &str, mode: u32) {
        fs::set_permissions(self.m.path(name), fs::Permissions::from_mode(mode)).expect("chmod");
    }

    fn mkdir(&self, name: &str, mode: u32) {
        fs::create_dir(self.m.path(name)).expect("mkdir");
        self.chmod(name, mode);
    }

    fn chown(&self, name: &str, uid: u32, gid: u32) {
        std::os::unix::fs::chown(self.m.path(name), Some(uid), Some(gid)).expect("chown");
    }

    fn mode(&self, name: &str) -> u32 {
        fs::symlink_metadata(self.m.path(name))
            .expect("stat")
            .mode()
            & 0o7777
    }

    fn gid(&self, name: &str) -> u32 {
        fs::symlink_metadata(self.m.path(name)).expect("stat").gid()
    }

    fn setfacl(&self, args: &[&str], name: &str) {
        let out = Command::new("setfacl")
            .args(args)
            .arg(self.m.path(name))
            .output()
            .expect("run setfacl");
        assert!(
            out.status.success(),
            "setfacl {args:?} {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `getfacl -c` as one line of space-separated entries, effective-rights comments
    /// dropped.
    fn getfacl(&self, name: &str) -> String {
        let out = Command::new("getfacl")
            .args(["-c", "-n"])
            .arg(self.m.path(name))
            .output()
            .expect("run getfacl");
        assert!(out.status.success(), "getfacl {name}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.split('\t').next().unwrap_or(""))
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[test]
fn sticky_setgid_umask_and_chown_as_on_ext4() {
    let Some(e) = setup("sticky_setgid_umask_chown", &[]) else {
        return;
    };
    // A /tmp-like directory: anyone creates, only the owner removes or renames away.
    e.mkdir("tmp", 0o1777);
    assert_eq!(
        e.as_user(ALICE, &["open", &e.p("tmp/a"), "w,creat"]),
        Ok(String::new())
    );
    assert_eq!(e.as_user(BOB, &["unlink", &e.p("tmp/a")]), Err(libc::EPERM));
    assert_eq!(
        e.as_user(BOB, &["rename", &e.p("tmp/a"), &e.p("tmp/b")]),
        Err(libc::EPERM)
    );
    assert_eq!(
        e.as_user(BOB, &["open", &e.p("tmp/b"), "w,creat"]),
        Ok(String::new())
    );
    assert_eq!(
        e.as_user(BOB, &["unlink", &e.p("tmp/b")]),
        Ok(String::new())
    );
    assert_eq!(
        e.as_user(ALICE, &["unlink", &e.p("tmp/a")]),
        Ok(String::new())
    );

    // Another user's private file.
    e.write("secret", 0o600);
    assert_eq!(e.read_as(ALICE, "secret"), Err(libc::EACCES));

    // umask 027: files 0644 → 0640, directories 0755 → 0750 (the helper's modes).
    assert_eq!(
        e.run_as(ALICE, &[], 0o027, &["open", &e.p("tmp/um"), "w,creat"]),
        Ok(String::new())
    );
    assert_eq!(e.mode("tmp/um"), 0o640);
    assert_eq!(
        e.run_as(ALICE, &[], 0o027, &["mkdir", &e.p("tmp/umd")]),
        Ok(String::new())
    );
    assert_eq!(e.mode("tmp/umd"), 0o750);

    // A set-group-id directory passes its group on, and the bit to subdirectories.
    e.mkdir("sg", 0o2777);
    e.chown("sg", 0, STAFF);
    e.chmod("sg", 0o2777);
    fs::create_dir(e.m.path("sg/sub")).expect("mkdir");
    fs::write(e.m.path("sg/f"), b"").expect("create");
    assert_eq!(
        (e.mode("sg/sub") & 0o2000, e.gid("sg/sub")),
        (0o2000, STAFF)
    );
    assert_eq!((e.mode("sg/f") & 0o2000, e.gid("sg/f")), (0, STAFF));
    assert_eq!(
        e.as_user(ALICE, &["mkdir", &e.p("sg/alice")]),
        Ok(String::new())
    );
    assert_eq!((e.mode("sg/alice"), e.gid("sg/alice")), (0o2755, STAFF));
    // ext4: a user outside the group cannot set the bit on its own file there (the
    // kernel drops it from the chmod).
    assert_eq!(
        e.as_user(ALICE, &["open", &e.p("sg/own"), "w,creat"]),
        Ok(String::new())
    );
    assert_eq!(
        e.as_user(ALICE, &["chmod", &e.p("sg/own"), "2755"]),
        Ok(String::new())
    );
    assert_eq!((e.mode("sg/own"), e.gid("sg/own")), (0o755, STAFF));

    // chown: nobody gives a file away; the group may change to one the owner is in.
    assert_eq!(
        e.as_user(ALICE, &["open", &e.p("tmp/own"), "w,creat"]),
        Ok(String::new())
    );
    assert_eq!(
        e.as_user(ALICE, &["chown", &e.p("tmp/own"), &BOB.to_string(), "-1"]),
        Err(libc::EPERM)
    );
    assert_eq!(
        e.run_as(
            ALICE,
            &[ALICE, 3000],
            0o022,
            &["chown", &e.p("tmp/own"), "-1", "3000"]
        ),
        Ok(String::new())
    );
    assert_eq!(e.gid("tmp/own"), 3000);
    assert_eq!(
        e.run_as(
            ALICE,
            &[ALICE, 3000],
            0o022,
            &["chown", &e.p("tmp/own"), "-1", "4000"]
        ),
        Err(libc::EPERM)
    );
    // chown clears set-user-id, and set-group-id when group execute is set; ext4 keeps
    // a set-group-id without group execute (it marks mandatory locking, not privilege).
    for (name, before, after) in [
        ("su", 0o4755, 0o755),
        ("sgx", 0o2755, 0o755),
        ("sgnox", 0o2745, 0o2745),
        ("both", 0o6755, 0o755),
    ] {
        e.write(name, before);
        e.chown(name, BOB, BOB);
        assert_eq!(e.mode(name), after, "{name}: {before:o} after chown");
    }
    // A write by the (unprivileged) owner clears them too.
    e.write("w", 0o6775);
    e.chown("w", ALICE, STAFF);
    e.chmod("w", 0o6775);
    assert_eq!(
        e.as_user(ALICE, &["write", &e.p("w"), "more"]),
        Ok(String::new())
    );
    // stat(1) asks statx for the mode alone, which the kernel answers from its cache
    // unless told the mode changed (it showed 6775 here).
    let shown = common::run_ok(Command::new("stat").args(["-c", "%a"]).arg(e.m.path("w")));
    assert_eq!(shown.trim(), "775", "stat -c %a after a write by the owner");
    assert_eq!(e.mode("w"), 0o775);
    e.m.stop();
}

#[test]
fn acls_are_enforced_as_on_ext4() {
    let Some(e) = setup("acls_enforced", &[]) else {
        return;
    };
    // Deny one named user what the mode grants everyone (found by a tester: uid 1000
    // still read the file).
    e.write("deny", 0o644);
    e.setfacl(&["-m", "u:1000:---"], "deny");
    assert_eq!(e.read_as(ALICE, "deny"), Err(libc::EACCES));
    assert_eq!(e.read_as(BOB, "deny"), Ok(String::new()));
    assert_eq!(
        e.mode("deny"),
        0o644,
        "the mask is r--: the group bits stay r"
    );
    assert_eq!(
        e.getfacl("deny"),
        "user::rw- user:1000:--- group::r-- mask::r-- other::r--"
    );

    // Grant one named user what the mode refuses everyone.
    e.write("grant", 0o600);
    e.setfacl(&["-m", "u:1000:r"], "grant");
    assert_eq!(e.read_as(ALICE, "grant"), Ok(String::new()));
    assert_eq!(e.read_as(BOB, "grant"), Err(libc::EACCES));
    assert_eq!(e.mode("grant"), 0o640, "the group bits show the mask");
    // The mask limits named entries.
    e.setfacl(&["-m", "m::---"], "grant");
    assert_eq!(e.read_as(ALICE, "grant"), Err(libc::EACCES));
    // chmod sets the mask, not the owning group's entry.
    e.chmod("grant", 0o640);
    assert_eq!(
        e.getfacl("grant"),
        "user::rw- user:1000:r-- group::--- mask::r-- other::---"
    );
    assert_eq!(e.read_as(ALICE, "grant"), Ok(String::new()));
    // A named group.
    e.write("g", 0o600);
    e.setfacl(&["-m", "g:3000:r"], "g");
    assert_eq!(
        e.run_as(BOB, &[BOB, 3000], 0o022, &["open", &e.p("g"), "r"]),
        Ok(String::new())
    );
    assert_eq!(e.read_as(BOB, "g"), Err(libc::EACCES));

    // An ACL the mode says in full is only a mode (no xattr, no `+`).
    e.write("equiv", 0o644);
    e.setfacl(&["-m", "u::rw,g::r,o::-"], "equiv");
    assert_eq!(e.mode("equiv"), 0o640);
    assert_eq!(
        common::helper(&["listxattr", &e.p("equiv"), "1024"]),
        Ok("0 ".to_string()),
        "no ACL xattr stored"
    );
    // Removing an ACL that is not there succeeds (ext4: 0, not ENODATA).
    assert_eq!(
        common::helper(&["removexattr", &e.p("equiv"), "system.posix_acl_access"]),
        Ok(String::new())
    );
    // Removing the ACL leaves the mode the mask made.
    e.setfacl(&["-b"], "deny");
    assert_eq!(e.mode("deny"), 0o644);
    assert_eq!(e.read_as(ALICE, "deny"), Ok(String::new()));
    // Malformed ACL values and default ACLs on files are refused, changing nothing.
    assert_eq!(
        common::helper(&[
            "setxattr",
            &e.p("grant"),
            "system.posix_acl_access",
            "x",
            "0"
        ]),
        Err(libc::EINVAL)
    );
    let out = Command::new("setfacl")
        .args(["-d", "-m", "u:1000:r"])
        .arg(e.m.path("grant"))
        .output()
        .expect("setfacl");
    assert!(!out.status.success(), "a default ACL on a file");
    // Only the owner sets ACLs (ext4: "Operation not permitted").
    let out = Command::new("setpriv")
        .args([
            "--reuid=1000",
            "--regid=1000",
            "--clear-groups",
            "setfacl",
            "-m",
            "u:1000:rw",
        ])
        .arg(e.m.path("grant"))
        .output()
        .expect("setfacl as alice");
    assert!(!out.status.success(), "setfacl by a non-owner");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(e.mode("grant"), 0o640);

    // Default ACLs: inherited as the access ACL (and by directories as their default
    // ACL too), the mode masked by them and the umask ignored (ext4: umask 077 still
    // gives rw-rw-r--).
    e.mkdir("shared", 0o755);
    e.setfacl(&["-m", "u:1000:rwx", "-d", "-m", "u:1000:rwx"], "shared");
    assert_eq!(
        e.run_as(0, &[], 0o077, &["open", &e.p("shared/f"), "w,creat"]),
        Ok(String::new())
    );
    // The helper creates with 0644: owner rw-, mask r-- (the mode's group bits), other r--.
    assert_eq!(e.mode("shared/f"), 0o644);
    assert_eq!(
        e.getfacl("shared/f"),
        "user::rw- user:1000:rwx group::r-x mask::r-- other::r--"
    );
    assert_eq!(
        e.as_user(ALICE, &["write", &e.p("shared/f"), "x"]),
        Err(libc::EACCES)
    );
    assert_eq!(
        e.run_as(0, &[], 0o077, &["mkdir", &e.p("shared/d")]),
        Ok(String::new())
    );
    assert_eq!(e.mode("shared/d"), 0o755);
    assert_eq!(
        e.getfacl("shared/d"),
        "user::rwx user:1000:rwx group::r-x mask::r-x other::r-x \
         default:user::rwx default:user:1000:rwx default:group::r-x default:mask::rwx \
         default:other::r-x"
    );
    // The subdirectory's mask is r-x (from the helper's 0755): Alice may not create there.
    assert_eq!(
        e.as_user(ALICE, &["open", &e.p("shared/d/a"), "w,creat"]),
        Err(libc::EACCES)
    );
    // Created with mode 0666 (touch), a file under the default ACL is rw-rw-r--.
    let out = Command::new("sh")
        .args(["-c", "umask 077; touch \"$0\""])
        .arg(e.m.path("shared/t"))
        .output()
        .expect("touch");
    assert!(out.status.success());
    assert_eq!(e.mode("shared/t"), 0o664);
    assert_eq!(
        e.as_user(ALICE, &["write", &e.p("shared/t"), "x"]),
        Ok(String::new())
    );
    e.m.stop();
}

#[test]
fn xattr_namespaces_as_another_user() {
    let Some(e) = setup("xattr_namespaces", &[]) else {
        return;
    };
    e.write("f", 0o644);
    // user.*: as writing the file (ext4: EACCES without write permission).
    assert_eq!(
        e.as_user(ALICE, &["setxattr", &e.p("f"), "user.a", "1", "0"]),
        Err(libc::EACCES)
    );
    assert_eq!(
        common::helper(&["setxattr", &e.p("f"), "user.a", "1", "0"]),
        Ok(String::new())
    );
    assert_eq!(
        e.as_user(ALICE, &["getxattr", &e.p("f"), "user.a", "16"]),
        Ok("1 1".to_string())
    );
    // trusted.*: root's only. ext4 answers EPERM to a set, ENODATA to a get, and lists
    // no trusted names to others.
    assert_eq!(
        common::helper(&["setxattr", &e.p("f"), "trusted.t", "1", "0"]),
        Ok(String::new())
    );
    assert_eq!(
        e.as_user(ALICE, &["setxattr", &e.p("f"), "trusted.u", "1", "0"]),
        Err(libc::EPERM)
    );
    assert_eq!(
        e.as_user(ALICE, &["getxattr", &e.p("f"), "trusted.t", "16"]),
        Err(libc::ENODATA)
    );
    assert_eq!(
        e.as_user(ALICE, &["listxattr", &e.p("f"), "1024"]),
        Ok("7 user.a".to_string())
    );
    assert_eq!(
        common::helper(&["listxattr", &e.p("f"), "1024"]),
        Ok("17 trusted.t,user.a".to_string())
    );
    // user.* on a sticky directory someone else owns: EPERM (ext4).
    e.mkdir("tmp", 0o1777);
    assert_eq!(
        e.as_user(ALICE, &["setxattr", &e.p("tmp"), "user.a", "1", "0"]),
        Err(libc::EPERM)
    );
    e.m.stop();
}

/// `df -i` shows the files present, within [the daemon's 2 s count cache].
fn inodes_used(mnt: &Path) -> u64 {
    let out = common::run_ok(Command::new("stat").args(["-f", "-c", "%c %d"]).arg(mnt));
    let n: Vec<u64> = out
        .split_whitespace()
        .map(|w| w.parse().expect("number"))
        .collect();
    n[0] - n[1]
}

/// Reads with O_DIRECT, so the READ reaches the daemon whatever the page cache holds
/// (a read served from cached pages never does, and leaves atime, as on NFS).
fn read_direct(p: &Path) -> usize {
    use std::{io::Read, os::unix::fs::OpenOptionsExt};
    let mut f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(p)
        .expect("open O_DIRECT");
    let mut buf = vec![0u8; 8192];
    f.read(&mut buf).expect("read O_DIRECT")
}

fn atime(p: &Path) -> (i64, i64) {
    let md = fs::metadata(p).expect("stat");
    (md.atime(), md.atime_nsec())
}

#[test]
fn statfs_counts_inodes_and_atime_follows_relatime() {
    let Some(e) = setup("statfs_atime", &[]) else {
        return;
    };
    let before = inodes_used(&e.m.mnt);
    assert!(before >= 1, "the root at least: {before}");
    fs::create_dir(e.m.path("many")).expect("mkdir");
    for i in 0..300 {
        fs::write(e.m.path(&format!("many/{i}")), b"").expect("create");
    }
    // The count is at most 2 s old.
    let deadline = Instant::now() + Duration::from_secs(10);
    while inodes_used(&e.m.mnt) < before + 301 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(200));
    }
    let after = inodes_used(&e.m.mnt);
    assert_eq!(after, before + 301, "df -i after 300 files and a directory");
    for i in 0..100 {
        fs::remove_file(e.m.path(&format!("many/{i}"))).expect("unlink");
    }
    thread::sleep(Duration::from_millis(2100));
    assert_eq!(
        inodes_used(&e.m.mnt),
        before + 201,
        "df -i after 100 unlinks"
    );

    // relatime: the first read after a write moves atime, the next one does not; a
    // change (chmod moves ctime) makes the next read move it again.
    let f = e.m.path("a");
    fs::write(&f, b"data").expect("write");
    let t0 = atime(&f);
    thread::sleep(Duration::from_millis(1100));
    e.chmod("a", 0o644);
    let t1 = atime(&f);
    assert_eq!(t1, t0, "chmod leaves atime");
    assert_eq!(read_direct(&f), 4);
    // The atime is written at the file's last close, and FUSE sends RELEASE after
    // close(2) has returned: allow it a moment (found failing once in CI).
    let mut t2 = atime(&f);
    assert!(
        common::eventually(Duration::from_secs(3), || {
            t2 = atime(&f);
            t2 > t1
        }),
        "the first read after the change moves atime: {t1:?} → {t2:?}"
    );
    thread::sleep(Duration::from_millis(1100));
    assert_eq!(read_direct(&f), 4);
    assert_eq!(atime(&f), t2, "read again: atime is after mtime and ctime");
    // A directory listing moves the directory's atime too (when due).
    let d = e.m.path("many");
    let d0 = atime(&d);
    thread::sleep(Duration::from_millis(1100));
    let _ = fs::read_dir(&d).expect("readdir").count();
    assert!(
        atime(&d) > d0,
        "readdir after the creates moves the directory's atime"
    );
    // Kept in etcd: after a remount (the page cache and daemon state are gone).
    let (fs_, m) = (e._fs, e.m);
    m.stop();
    let m = fs_.mount("auto", &["--allow-other"]);
    assert_eq!(atime(&m.path("a")), t2, "the read's atime reached etcd");

    // --noatime: reads leave atime alone.
    m.stop();
    let m = fs_.mount("auto", &["--allow-other", "--noatime"]);
    fs::set_permissions(m.path("a"), fs::Permissions::from_mode(0o600)).expect("chmod");
    let n0 = atime(&m.path("a"));
    assert_eq!(read_direct(&m.path("a")), 4);
    assert_eq!(atime(&m.path("a")), n0, "noatime");
    m.stop();
}

/// Another node's ACL change reaches this node's kernel, which caches ACLs (and their
/// absence) apart from attributes; a create right after another node set the directory's
/// default ACL inherits it.
#[test]
fn acl_changes_reach_other_nodes() {
    let Some(e) = setup("acl_other_nodes", &[]) else {
        return;
    };
    let b = e._fs.mount_node("b", "auto", &["--allow-other"]);
    fs::set_permissions(&b.mnt, fs::Permissions::from_mode(0o755)).expect("chmod");
    let on_b = |name: &str| b.path(name).to_string_lossy().into_owned();
    let read_on_b = |uid: u32, name: &str| e.as_user(uid, &["open", &on_b(name), "r"]);
    e.write("f", 0o644);
    // B's kernel learns that f has no ACL (its first permission check as a non-owner).
    assert_eq!(read_on_b(ALICE, "f"), Ok(String::new()));
    e.setfacl(&["-m", "u:1000:---"], "f");
    let deadline = Instant::now() + Duration::from_secs(5);
    while read_on_b(ALICE, "f").is_ok() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        read_on_b(ALICE, "f"),
        Err(libc::EACCES),
        "deny set on A, read on B"
    );
    assert_eq!(read_on_b(BOB, "f"), Ok(String::new()));
    // And back: B's kernel now caches the denying ACL.
    e.setfacl(&["-b"], "f");
    let deadline = Instant::now() + Duration::from_secs(5);
    while read_on_b(ALICE, "f").is_err() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(read_on_b(ALICE, "f"), Ok(String::new()), "ACL removed on A");

    // A default ACL set on A, a file created on B at once.
    e.mkdir("d", 0o755);
    assert!(b.path("d").is_dir());
    e.setfacl(&["-d", "-m", "u:1000:rw"], "d");
    fs::write(b.path("d/new"), b"").expect("create on B");
    assert_eq!(
        e.getfacl("d/new"),
        "user::rw- user:1000:rw- group::r-x mask::rw- other::r--",
        "created on B right after A set the default ACL"
    );
    b.stop();
    e.m.stop();
}
