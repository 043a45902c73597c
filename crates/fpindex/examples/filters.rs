//! Filter choice by measurement: bits per entry, false-positive rate and
//! ns per lookup of the candidate filters at N keys (first argument,
//! default 10 M). Run: `cargo run --release -p onecopy-fpindex --example filters -- 10000000`.

use std::hint::black_box;
use std::time::Instant;

use xorf::{BinaryFuse16, BinaryFuse8, Filter};

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Row {
    name: &'static str,
    bytes: usize,
    fpr: f64,
    ns_neg: f64,
    ns_pos: f64,
}

fn measure(
    name: &'static str,
    bytes: usize,
    keys: &[u64],
    probes: &[u64],
    f: impl Fn(u64) -> bool,
) -> Row {
    let t = Instant::now();
    let mut fp = 0usize;
    for &p in probes {
        fp += f(p) as usize;
    }
    let ns_neg = t.elapsed().as_nanos() as f64 / probes.len() as f64;
    let t = Instant::now();
    let mut hit = 0usize;
    for &k in keys.iter().take(probes.len()) {
        hit += black_box(f(k)) as usize;
    }
    let ns_pos = t.elapsed().as_nanos() as f64 / probes.len().min(keys.len()) as f64;
    assert_eq!(hit, probes.len().min(keys.len()), "{name}: false negative");
    Row {
        name,
        bytes,
        fpr: fp as f64 / probes.len() as f64,
        ns_neg,
        ns_pos,
    }
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(10_000_000);
    let mut s = 1u64;
    let keys: Vec<u64> = (0..n).map(|_| splitmix(&mut s)).collect();
    let probes: Vec<u64> = (0..n.min(10_000_000)).map(|_| splitmix(&mut s)).collect();
    let mut rows = Vec::new();
    let t = Instant::now();
    let f16 = BinaryFuse16::try_from(&keys).expect("fuse16");
    eprintln!("fuse16 build {:?}", t.elapsed());
    rows.push(measure(
        "xorf BinaryFuse16",
        f16.fingerprints.len() * 2,
        &keys,
        &probes,
        |k| f16.contains(&k),
    ));
    drop(f16);
    let t = Instant::now();
    let f8 = BinaryFuse8::try_from(&keys).expect("fuse8");
    eprintln!("fuse8 build {:?}", t.elapsed());
    rows.push(measure(
        "xorf BinaryFuse8",
        f8.fingerprints.len(),
        &keys,
        &probes,
        |k| f8.contains(&k),
    ));
    drop(f8);
    for (name, fpr) in [("fastbloom 1e-3", 1e-3), ("fastbloom 1e-5", 1e-5)] {
        let mut b = fastbloom::BloomFilter::with_false_pos(fpr).expected_items(n);
        for &k in &keys {
            b.insert(&k);
        }
        rows.push(measure(name, b.num_bits() / 8, &keys, &probes, |k| {
            b.contains(&k)
        }));
    }
    let mut q = qfilter::Filter::new(n as u64, 1e-4).expect("qfilter");
    for &k in &keys {
        q.insert_fingerprint(false, k).expect("qfilter insert");
    }
    let qb = q.memory_usage();
    rows.push(measure("qfilter 1e-4", qb, &keys, &probes, |k| {
        q.contains_fingerprint(k)
    }));
    println!("| filter | bits/entry | FPR | ns/negative lookup | ns/positive lookup |");
    println!("|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {:.2} | {:.2e} | {:.1} | {:.1} |",
            r.name,
            r.bytes as f64 * 8.0 / n as f64,
            r.fpr,
            r.ns_neg,
            r.ns_pos
        );
    }
}
