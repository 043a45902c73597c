//! Crash test: a real child process inserting into a real index directory
//! is killed with SIGKILL at random moments (during inserts, flushes and
//! merges); after each kill the index is reopened and every committed
//! entry must be present with its location and reference count, and
//! nothing never inserted may appear.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use onecopy_fpindex::{Config, Index, Mode};

fn key(i: u64) -> u128 {
    (i as u128 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835)
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// Runs the child until killed after `delay`; returns the highest
/// committed count it printed.
fn run_child(dir: &std::path::Path, from: u64, to: u64, delay: Duration) -> u64 {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fpindex-crashtest"))
        .args([dir.to_str().unwrap(), &from.to_string(), &to.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(n) = line
                .strip_prefix("committed ")
                .and_then(|n| n.parse::<u64>().ok())
            {
                let _ = tx.send(n);
            }
        }
    });
    let start = Instant::now();
    while start.elapsed() < delay {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = child.kill(); // SIGKILL
    let status = child.wait().unwrap();
    reader.join().unwrap();
    let committed = rx.try_iter().max().unwrap_or(from);
    assert!(
        status.code().is_none() || status.success(),
        "child failed: {status}"
    );
    committed
}

#[test]
fn kill_9_loses_no_committed_entry() {
    let dir = tempfile::Builder::new()
        .prefix("fpindex-crash")
        .tempdir_in("/var/tmp")
        .unwrap();
    let mut seed = 0x2545_F491_4F6C_DD1D ^ std::process::id() as u64;
    let total = 60_000;
    let mut committed = 0;
    for round in 0..12 {
        let delay = Duration::from_millis(20 + xorshift(&mut seed) % 400);
        let to = (committed + 20_000).min(total);
        let c = run_child(dir.path(), committed, to, delay);
        assert!(c >= committed);
        committed = c;
        let cfg = Config {
            mode: Mode::Eager,
            ..Default::default()
        };
        let mut ix =
            Index::open(dir.path(), cfg).unwrap_or_else(|e| panic!("round {round}: reopen: {e}"));
        for i in 0..committed {
            let e = ix
                .get(key(i))
                .unwrap()
                .unwrap_or_else(|| panic!("round {round}: committed key {i} lost"));
            assert_eq!(e.loc, i, "round {round}: key {i}");
            assert_eq!(
                e.refs,
                if i % 7 == 0 { 2 } else { 1 },
                "round {round}: refs of {i}"
            );
        }
        // Uncommitted keys may or may not be there, but never wrong;
        // keys never inserted are never there.
        for i in committed..committed + 30_000 {
            if let Some(e) = ix.get(key(i)).unwrap() {
                assert_eq!(e.loc, i, "round {round}: invented location for {i}");
                assert!(i < to, "round {round}: key {i} was never inserted");
            }
        }
        assert!(
            ix.len() >= committed && ix.len() <= to,
            "round {round}: len {}",
            ix.len()
        );
        eprintln!(
            "round {round}: killed after {delay:?}, committed {committed}, runs {}",
            ix.runs()
        );
        if committed >= total {
            break;
        }
    }
    assert!(committed > 0, "the child never committed anything");
}
