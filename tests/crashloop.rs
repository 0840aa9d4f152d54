//! Crash loops (issue 15): two nodes (two daemons on one device image and one etcd) run a
//! mixed workload on files in one shared directory per cycle (creates, renames, appends,
//! overwrites, truncates, fsyncs, from both nodes) and one node is killed with SIGKILL at a
//! seeded random moment. The killed node is mounted again; every byte an fsync
//! acknowledged must be there (bytes written after a file's last fsync may be old or new),
//! and `etcfs fsck` must find the filesystem clean, then, both nodes unmounted at the end,
//! clean offline too.
//!
//! `CRASHLOOP_CYCLES` (default 3, the CI form) and `CRASHLOOP_SEED` (default: from the
//! clock, printed) choose the run; `scripts/crashloop.sh --cycles 50` is the long form.
//!
//! Needs root, `/dev/fuse` and `ETCD_ENDPOINTS` (see `common`); skips loudly otherwise,
//! and fails instead when `ETCFS_REQUIRE_MOUNT_TESTS=1`.

mod common;

use std::{
    fs::{self, OpenOptions},
    io::{Seek as _, SeekFrom, Write as _},
    path::PathBuf,
    process::Command,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use common::{loud, noise, run_bounded, Daemon, TestFs, ETCFS};
use rand::{rngs::SmallRng, Rng as _, SeedableRng as _};
use serde_json::Value;

/// Lease TTL of both nodes: a dead node's locks pass on within it.
const TTL: &str = "2";
/// Files a worker keeps at once.
const FILES_PER_WORKER: usize = 3;
/// Worker threads per node.
const WORKERS_PER_NODE: usize = 2;
/// Largest file a worker grows.
const FILE_MAX: u64 = 256 << 10;

/// What the oracle knows of one file.
#[derive(Clone, Debug)]
struct FileState {
    name: String,
    /// Content at the last acknowledged fsync.
    synced: Vec<u8>,
    /// What the file holds if every write since reached it.
    current: Vec<u8>,
    /// Byte ranges written or cut since the last fsync: old or new after a crash.
    dirty: Vec<(u64, u64)>,
    /// The smallest size the file had since the last fsync (truncates are immediate).
    min_len: u64,
    /// A rename in flight when the node died: the file may be under this name instead.
    maybe_renamed: Option<String>,
    /// Created by an operation in flight when the node died: it may not exist.
    maybe_absent: bool,
}

impl FileState {
    fn new(name: String) -> FileState {
        FileState {
            name,
            synced: Vec::new(),
            current: Vec::new(),
            dirty: Vec::new(),
            min_len: 0,
            maybe_renamed: None,
            maybe_absent: true,
        }
    }

    fn synced_now(&mut self) {
        self.synced = self.current.clone();
        self.dirty.clear();
        self.min_len = self.synced.len() as u64;
    }

    /// Checks what was read after the crash; `Err` says what is wrong.
    fn check(&self, got: &[u8]) -> Result<(), String> {
        if (got.len() as u64) < self.min_len.min(self.synced.len() as u64) {
            return Err(format!(
                "{} bytes, {} were fsync'd (and never cut since)",
                got.len(),
                self.min_len.min(self.synced.len() as u64)
            ));
        }
        let n = got.len().min(self.synced.len());
        for i in 0..n {
            let dirty = self
                .dirty
                .iter()
                .any(|&(s, e)| (i as u64) >= s && (i as u64) < e);
            if !dirty && got[i] != self.synced[i] {
                return Err(format!(
                    "byte {i} is {:#04x}, {:#04x} was fsync'd there",
                    got[i], self.synced[i]
                ));
            }
        }
        Ok(())
    }
}

/// One worker: a few files in the cycle's shared directory, changed at random.
fn worker(
    mnt: PathBuf,
    dir: String,
    id: String,
    seed: u64,
    stop: Arc<AtomicBool>,
    killed: Arc<AtomicBool>,
) -> Vec<FileState> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut files: Vec<FileState> = Vec::new();
    let mut n = 0u64;
    let path = |name: &str| mnt.join(&dir).join(name);
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let op = if files.len() < FILES_PER_WORKER {
            0
        } else {
            rng.gen_range(1..=6)
        };
        let r: std::io::Result<()> = (|| {
            match op {
                0 => {
                    files.push(FileState::new(format!("{id}-{n}")));
                    let f = files.last_mut().expect("pushed");
                    let data = noise(rng.gen_range(1..64 << 10), seed ^ n);
                    f.dirty.push((0, data.len() as u64));
                    fs::write(path(&f.name), &data)?;
                    f.maybe_absent = false;
                    f.current = data;
                }
                1 => {
                    let i = rng.gen_range(0..files.len());
                    let to = format!("{id}-{n}");
                    files[i].maybe_renamed = Some(to.clone());
                    fs::rename(path(&files[i].name), path(&to))?;
                    files[i].name = to;
                    files[i].maybe_renamed = None;
                }
                2 | 3 => {
                    // Append (2) or overwrite inside the file (3).
                    let i = rng.gen_range(0..files.len());
                    let f = &mut files[i];
                    let len = f.current.len() as u64;
                    let at = if op == 2 || len == 0 {
                        len
                    } else {
                        rng.gen_range(0..len)
                    };
                    if at >= FILE_MAX {
                        return Ok(());
                    }
                    let data = noise(rng.gen_range(1..32 << 10), seed ^ (n << 8));
                    let end = at + data.len() as u64;
                    f.dirty.push((at, end));
                    let mut h = OpenOptions::new().write(true).open(path(&f.name))?;
                    h.seek(SeekFrom::Start(at))?;
                    h.write_all(&data)?;
                    drop(h);
                    if f.current.len() < end as usize {
                        f.current.resize(end as usize, 0);
                    }
                    f.current[at as usize..end as usize].copy_from_slice(&data);
                }
                4 => {
                    let i = rng.gen_range(0..files.len());
                    let f = &mut files[i];
                    let len = f.current.len() as u64;
                    let to = rng.gen_range(0..=len + 8192);
                    f.dirty.push((to.min(len), to.max(len)));
                    f.min_len = f.min_len.min(to);
                    OpenOptions::new()
                        .write(true)
                        .open(path(&f.name))?
                        .set_len(to)?;
                    f.current.resize(to as usize, 0);
                }
                _ => {
                    let i = rng.gen_range(0..files.len());
                    let f = &mut files[i];
                    OpenOptions::new()
                        .write(true)
                        .open(path(&f.name))?
                        .sync_all()?;
                    f.synced_now();
                }
            }
            Ok(())
        })();
        if let Err(e) = r {
            assert!(
                killed.load(Ordering::SeqCst),
                "worker {id}: operation {op} failed on a live node: {e}"
            );
            break;
        }
    }
    files
}

/// `etcfs fsck --json`: exit code and report.
fn fsck(fs: &TestFs) -> (i32, Value) {
    let (out, in_time) = run_bounded(
        Command::new(ETCFS)
            .args(["fsck", "--etcd", &fs.endpoints, "--device"])
            .arg(&fs.image)
            .args(["--prefix", &fs.prefix, "--json"]),
        Duration::from_secs(60),
    );
    assert!(in_time, "fsck hung");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "fsck --json ({e}): {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), v)
}

/// fsck must be clean; findings that may be the mounted nodes' work in progress get a few
/// seconds to settle.
fn assert_fsck_clean(fs: &TestFs, when: &str, seed: u64) {
    let t0 = Instant::now();
    loop {
        let (code, v) = fsck(fs);
        if code == 0 {
            return;
        }
        let all_in_flux = v["findings"]
            .as_array()
            .is_some_and(|f| f.iter().all(|f| f["in_flux"] == true));
        if !all_in_flux || t0.elapsed() > Duration::from_secs(15) {
            panic!("{when}: fsck exit {code} (seed {seed}):\n{v:#}");
        }
        thread::sleep(Duration::from_millis(500));
    }
}

/// Reads every file the oracle knows (on `m`) and checks it.
fn verify(m: &Daemon, dir: &str, files: &[FileState], seed: u64, cycle: u64) {
    for f in files {
        let read = |name: &str| fs::read(m.mnt.join(dir).join(name)).ok();
        let got = read(&f.name).or_else(|| f.maybe_renamed.as_deref().and_then(read));
        let Some(got) = got else {
            assert!(
                f.maybe_absent,
                "cycle {cycle} (seed {seed}): {dir}/{} is gone",
                f.name
            );
            continue;
        };
        if let Err(e) = f.check(&got) {
            panic!("cycle {cycle} (seed {seed}): {dir}/{}: {e}", f.name);
        }
    }
}

fn mount(fs: &TestFs, node: &str) -> Daemon {
    fs.mount_node(node, "auto", &["--lease-ttl", TTL])
}

#[test]
fn kill_one_of_two_nodes_then_fsync_d_data_is_there_and_fsck_is_clean() {
    let cycles: u64 = std::env::var("CRASHLOOP_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let seed: u64 = std::env::var("CRASHLOOP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    let Some(fs) = common::small_groups("crashloop", 512 << 20, 8) else {
        return;
    };
    loud(&format!(
        "crashloop: seed {seed}, {cycles} cycles (replay: CRASHLOOP_SEED={seed})"
    ));
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut nodes = [Some(mount(&fs, "a")), Some(mount(&fs, "b"))];
    let mut history: Vec<(String, Vec<FileState>)> = Vec::new();
    let t_start = Instant::now();
    for cycle in 0..cycles {
        let dir = format!("c{cycle}");
        fs::create_dir(nodes[0].as_ref().unwrap().mnt.join(&dir)).unwrap();
        // Names reach another node through its etcd watch (milliseconds), not at once.
        let other = nodes[1].as_ref().unwrap().mnt.join(&dir);
        assert!(
            common::eventually(Duration::from_secs(5), || other.is_dir()),
            "{dir} never appeared on the other node"
        );
        let stop = Arc::new(AtomicBool::new(false));
        let killed = [
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        ];
        let mut handles = Vec::new();
        for (ni, node) in nodes.iter().enumerate() {
            let mnt = node.as_ref().unwrap().mnt.clone();
            for w in 0..WORKERS_PER_NODE {
                let (mnt, dir, stop, killed) =
                    (mnt.clone(), dir.clone(), stop.clone(), killed[ni].clone());
                let id = format!("n{ni}w{w}");
                let wseed = seed ^ (cycle << 32) ^ ((ni * 16 + w) as u64);
                handles.push(thread::spawn(move || {
                    (dir.clone(), worker(mnt, dir, id, wseed, stop, killed))
                }));
            }
        }
        let victim = rng.gen_range(0..2usize);
        let after = Duration::from_millis(rng.gen_range(200..1500));
        thread::sleep(after);
        killed[victim].store(true, Ordering::SeqCst);
        let by_itself = nodes[victim].take().unwrap().crash();
        // The survivor keeps working a moment while the dead node's lease runs out.
        thread::sleep(Duration::from_millis(rng.gen_range(0..500)));
        stop.store(true, Ordering::SeqCst);
        let (mut nfiles, mut synced) = (0, 0);
        for h in handles {
            let (d, files) = h.join().expect("worker panicked");
            nfiles += files.len();
            synced += files.iter().map(|f| f.synced.len()).sum::<usize>();
            history.push((d, files));
        }
        nodes[victim] = Some(mount(&fs, if victim == 0 { "a" } else { "b" }));
        loud(&format!(
            "crashloop cycle {cycle}: killed node {victim} after {after:?}; {nfiles} files, \
             {synced} bytes fsync'd{}",
            if by_itself {
                ""
            } else {
                " (its connection had to be aborted)"
            }
        ));
        // Every file of every cycle so far, read on the node that was killed.
        let m = nodes[victim].as_ref().unwrap();
        for (d, files) in &history {
            verify(m, d, files, seed, cycle);
        }
        assert_fsck_clean(&fs, &format!("cycle {cycle}, both nodes mounted"), seed);
    }
    for n in nodes.iter_mut() {
        n.take().unwrap().stop();
    }
    let (code, v) = fsck(&fs);
    assert_eq!(
        code, 0,
        "offline fsck after {cycles} cycles (seed {seed}):\n{v:#}"
    );
    loud(&format!(
        "crashloop: {cycles} cycles clean in {:.1} s (seed {seed})",
        t_start.elapsed().as_secs_f64()
    ));
}
