//! The endpoint's own throughput through this crate's S3 client: `N`
//! objects of `SIZE` bytes put one after the other (`put_new`), then read
//! back by ranged GETs of the same size, one at a time (the concurrency
//! of the store's upload thread and of its cache's fetches). The ceiling
//! bench/remote-throughput.sh compares a mount's writes and cold reads
//! with.
//!
//! Usage: throughput s3://BUCKET/PREFIX ENDPOINT [N] [SIZE_MIB] [PHASES]
//! (credentials from the environment, as the store takes them); PHASES
//! is a comma-separated subset of `put,get,whole,delete` (all but `whole`
//! by default; `whole` is one unranged GET per object, as the store's
//! cache fetches a container), so that a caller can measure each phase on
//! its own.

use std::time::Instant;

use onecopy_objects::{Objects, S3Config, S3Objects};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: throughput s3://BUCKET/PREFIX ENDPOINT [N] [SIZE_MIB]");
        std::process::exit(2);
    }
    let mut c = S3Config::from_url(&args[1]).expect("s3://BUCKET/PREFIX");
    c.endpoint = Some(args[2].clone());
    let n: usize = args.get(3).map_or(64, |s| s.parse().expect("N"));
    let size: usize = args
        .get(4)
        .map_or(16, |s| s.parse::<usize>().expect("SIZE_MIB"))
        << 20;
    let phases = args.get(5).map_or("put,get,delete", |s| s.as_str());
    let has = |p: &str| phases.split(',').any(|x| x == p);
    let o = S3Objects::new(&c).expect("client");
    // Incompressible bytes, different per object.
    let mut body = vec![0u8; size];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in body.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
    }
    if has("put") {
        timed("put", n, size, |i, key| {
            body[..8].copy_from_slice(&(i as u64).to_le_bytes());
            o.put_new(key, body.clone().into()).expect("put");
        });
    }
    if has("get") {
        timed("ranged get", n, size, |_, key| {
            let got = o.get_range(key, 0..size as u64).expect("get");
            assert_eq!(got.len(), size);
        });
    }
    if has("whole") {
        timed("whole get", n, size, |_, key| {
            let got = o.get_at_most(key, size as u64).expect("get");
            assert_eq!(got.map(|b| b.len()), Some(size));
        });
    }
    if has("delete") {
        for i in 0..n {
            let _ = o.delete(&key(i));
        }
    }
}

/// Object `i`'s key.
fn key(i: usize) -> String {
    format!("throughput/{i:08}")
}

/// Calls `each` for objects `0..n` (with each key) and prints how long
/// the `what` of `n` objects of `size` bytes took.
fn timed(what: &str, n: usize, size: usize, mut each: impl FnMut(usize, &str)) {
    let t = Instant::now();
    for i in 0..n {
        each(i, &key(i));
    }
    let secs = t.elapsed().as_secs_f64();
    let mib = (n * size) as f64 / (1 << 20) as f64;
    println!(
        "{what} {n} x {} MiB: {secs:.2} s, {:.0} MiB/s",
        size >> 20,
        mib / secs
    );
}
