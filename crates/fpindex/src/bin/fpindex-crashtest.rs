//! Child process of the crash test (tests/crash.rs): inserts keys
//! `from..to` into the index at DIR with a small memtable (so flushes and
//! merges happen all the time), committing every few hundred inserts and
//! printing `committed N` (all keys below N durable) after each commit.
//! The test kills it with SIGKILL at a random moment.

use std::io::Write;
use std::path::PathBuf;

use onecopy_fpindex::{Config, Index, Mode};

/// Key number `i` of the test (spread over the key space).
pub fn key(i: u64) -> u128 {
    (i as u128 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: fpindex-crashtest DIR FROM TO");
        std::process::exit(2);
    }
    let dir = PathBuf::from(&args[1]);
    let (from, to): (u64, u64) = match (args[2].parse(), args[3].parse()) {
        (Ok(a), Ok(b)) => (a, b),
        _ => {
            eprintln!("FROM and TO must be numbers");
            std::process::exit(2);
        }
    };
    let cfg = Config {
        memtable_entries: 3000,
        max_runs: 4,
        mode: Mode::Eager,
        ..Default::default()
    };
    let mut ix = match Index::open(&dir, cfg) {
        Ok(ix) => ix,
        Err(e) => {
            eprintln!("open: {e}");
            std::process::exit(1);
        }
    };
    let mut out = std::io::stdout();
    for i in from..to {
        if let Err(e) = ix.insert(key(i), i, (i % 100) as u32) {
            eprintln!("insert: {e}");
            std::process::exit(1);
        }
        // Every 7th key holds two references (idempotent across restarts:
        // an uncommitted insert may have survived the kill).
        if i % 7 == 0 && ix.get(key(i)).ok().flatten().is_some_and(|e| e.refs == 1) {
            let _ = ix.incref(key(i));
        }
        if (i + 1) % 250 == 0 || i + 1 == to {
            if let Err(e) = ix.commit() {
                eprintln!("commit: {e}");
                std::process::exit(1);
            }
            let _ = writeln!(out, "committed {}", i + 1);
            let _ = out.flush();
        }
    }
}
