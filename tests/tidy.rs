//! Text-level checks of the source tree that the compiler and clippy do not make: where
//! `unsafe` may appear, and that every source file says what it is for.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// The only places `unsafe` may appear: the io_uring runtime, and the parts of `fusedev`
/// that talk to the kernel (mount and transports).
const UNSAFE_ALLOWED: &[&str] = &[
    "uring/src/",
    "fusedev/src/mount.rs",
    "fusedev/src/transport/",
];

/// Source trees checked (relative to the workspace root).
const TREES: &[&str] = &[
    "src", "uring", "fusedev", "meta", "perf", "tests", "benches",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.file_name().is_some_and(|n| n == "target") {
            continue;
        }
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn workspace_files() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for t in TREES {
        rust_files(&root.join(t), &mut files);
    }
    assert!(files.len() > 20, "found only {} source files", files.len());
    files
        .into_iter()
        .map(|p| {
            let rel = p
                .strip_prefix(root)
                .expect("under root")
                .to_string_lossy()
                .into_owned();
            let text = fs::read_to_string(&p).expect("read source");
            (rel, text)
        })
        .collect()
}

/// True when the line uses `unsafe` as code (not inside a comment or a string literal).
fn uses_unsafe(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    let mut in_str = false;
    let mut stripped = String::new();
    for c in code.chars() {
        if c == '"' {
            in_str = !in_str;
        } else if !in_str {
            stripped.push(c);
        }
    }
    stripped
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .any(|w| w == "unsafe")
        && !stripped.contains("unsafe_code")
        && !stripped.contains("unsafe_op_in_unsafe_fn")
}

#[test]
fn unsafe_only_where_allowed() {
    let mut offenders = Vec::new();
    for (path, text) in workspace_files() {
        // This file names `unsafe` in its own test data.
        if UNSAFE_ALLOWED.iter().any(|a| path.starts_with(a)) || path == "tests/tidy.rs" {
            continue;
        }
        for (n, line) in text.lines().enumerate() {
            if uses_unsafe(line) {
                offenders.push(format!("{path}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "unsafe outside {UNSAFE_ALLOWED:?}:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn every_library_file_has_a_module_doc() {
    let missing: Vec<String> = workspace_files()
        .into_iter()
        .filter(|(p, _)| p.contains("/src/") || p.starts_with("src/"))
        .filter(|(_, t)| !t.trim_start().starts_with("//!"))
        .map(|(p, _)| p)
        .collect();
    assert!(
        missing.is_empty(),
        "files without a //! module doc: {missing:?}"
    );
}

#[test]
fn the_unsafe_detector_detects() {
    assert!(uses_unsafe("    let x = unsafe { f() };"));
    assert!(uses_unsafe("unsafe impl Send for X {}"));
    assert!(!uses_unsafe("// unsafe is fine in comments"));
    assert!(!uses_unsafe(r#"let s = "unsafe";"#));
    assert!(!uses_unsafe("#![forbid(unsafe_code)]"));
}
