//! The object seam's contract, checked on both implementations: a local
//! directory and a real S3 server (SeaweedFS `weed mini`, started here;
//! the test fails if it cannot start).

use std::sync::{Arc, Barrier};
use std::time::Duration;

use bytes::Bytes;
use onecopy_objects::{LocalObjects, ObjectError, Objects, S3Config, S3Objects, Tag};
use onecopy_testfs::Weed;

fn s3(weed: &Weed, prefix: &str, patience: Duration) -> S3Objects {
    weed.export_env();
    let mut c = S3Config::from_url(&format!("s3://{}/{prefix}", weed.bucket)).unwrap();
    c.endpoint = Some(weed.endpoint.clone());
    c.patience = patience;
    S3Objects::new(&c).unwrap()
}

/// The bucket answers (weed mini creates it shortly after its port opens).
fn ready(o: &dyn Objects) {
    let t0 = std::time::Instant::now();
    loop {
        match o.list("") {
            Ok(_) => return,
            Err(e) if t0.elapsed() > Duration::from_secs(60) => panic!("S3 not ready: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

fn contract(o: &dyn Objects) {
    let a = Bytes::from((0..200_000u32).map(|i| (i * 7) as u8).collect::<Vec<_>>());
    o.put_new("c/00/a", a.clone()).unwrap();
    // Written once: a second put of the key is refused, the first stays.
    let e = o
        .put_new("c/00/a", Bytes::from_static(b"other"))
        .unwrap_err();
    assert!(matches!(e, ObjectError::Exists { .. }), "{e}");
    assert_eq!(o.get("c/00/a").unwrap().0, a);
    assert_eq!(o.size("c/00/a").unwrap(), Some(200_000));
    assert_eq!(o.size("c/00/missing").unwrap(), None);
    assert_eq!(
        o.get_range("c/00/a", 1000..1010).unwrap(),
        a.slice(1000..1010)
    );
    assert_eq!(
        o.get_range("c/00/a", 199_990..200_000).unwrap(),
        a.slice(199_990..)
    );
    let e = o.get("c/00/missing").unwrap_err();
    assert!(matches!(e, ObjectError::NotFound { .. }), "{e}");
    // Whole only when short enough; a longer or absent object is `None`.
    assert_eq!(o.get_at_most("c/00/a", 200_000).unwrap(), Some(a.clone()));
    assert_eq!(o.get_at_most("c/00/a", 199_999).unwrap(), None);
    assert_eq!(o.get_at_most("c/00/missing", 1 << 30).unwrap(), None);
    // The connection a refused body was dropped on is not reused broken.
    assert_eq!(o.get_at_most("c/00/a", u64::MAX).unwrap(), Some(a.clone()));

    // The manifest: created once, replaced only from the version read.
    let t1 = o
        .swap("manifest", Bytes::from_static(b"one"), None)
        .unwrap();
    let e = o
        .swap("manifest", Bytes::from_static(b"x"), None)
        .unwrap_err();
    assert!(matches!(e, ObjectError::Conflict { .. }), "{e}");
    let t2 = o
        .swap("manifest", Bytes::from_static(b"two"), Some(&t1))
        .unwrap();
    assert_ne!(t1, t2);
    let e = o
        .swap("manifest", Bytes::from_static(b"stale"), Some(&t1))
        .unwrap_err();
    assert!(matches!(e, ObjectError::Conflict { .. }), "{e}");
    let (now, tag) = o.get("manifest").unwrap();
    assert_eq!((&now[..], &tag), (&b"two"[..], &t2));
    let e = o
        .swap("nothing", Bytes::from_static(b"x"), Some(&t2))
        .unwrap_err();
    assert!(matches!(e, ObjectError::Conflict { .. }), "{e}");

    o.put_new("c/01/b", Bytes::from_static(b"bb")).unwrap();
    let mut keys: Vec<_> = o
        .list("c")
        .unwrap()
        .into_iter()
        .map(|l| (l.key, l.size))
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        [("c/00/a".to_string(), 200_000), ("c/01/b".to_string(), 2)]
    );
    assert_eq!(o.list("c/01").unwrap().len(), 1);
    assert_eq!(o.list("").unwrap().len(), 3);

    o.delete("c/00/a").unwrap();
    o.delete("c/00/a").unwrap();
    assert!(matches!(o.get("c/00/a"), Err(ObjectError::NotFound { .. })));
    let e = o.put_new("../x", Bytes::new()).unwrap_err();
    assert!(matches!(e, ObjectError::BadKey { .. }), "{e}");
}

/// Of 8 writers swapping from the same version at once, exactly one wins.
fn race(o: Arc<dyn Objects>) {
    let t0 = o.swap("lease", Bytes::from_static(b"0"), None).unwrap();
    let go = Arc::new(Barrier::new(8));
    let handles: Vec<_> = (0..8u8)
        .map(|i| {
            let (o, go, t0) = (o.clone(), go.clone(), t0.clone());
            std::thread::spawn(move || {
                go.wait();
                o.swap("lease", Bytes::from(vec![b'1' + i]), Some(&t0))
            })
        })
        .collect();
    let won: Vec<Tag> = handles
        .into_iter()
        .filter_map(|h| match h.join().unwrap() {
            Ok(t) => Some(t),
            Err(ObjectError::Conflict { .. }) => None,
            Err(e) => panic!("{e}"),
        })
        .collect();
    assert_eq!(won.len(), 1, "exactly one swap wins");
    assert_eq!(o.get("lease").unwrap().1, won[0]);
}

#[test]
fn local_directory_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let o = LocalObjects::new(dir.path().join("objects")).unwrap();
    contract(&o);
    race(Arc::new(o));
}

#[test]
fn s3_server_keeps_the_contract() {
    let weed = Weed::start("onecopy-contract").expect("start weed mini");
    let o = s3(&weed, "store1", Duration::from_secs(30));
    ready(&o);
    contract(&o);
    race(Arc::new(s3(&weed, "store2", Duration::from_secs(30))));
    // Another prefix of the same bucket is another set of objects.
    assert!(s3(&weed, "store3", Duration::from_secs(30))
        .list("")
        .unwrap()
        .is_empty());
}

/// A server killed and restarted: a put made while it is down is retried
/// until it is back and then reads back whole; what was put before the
/// crash is still there.
#[test]
fn s3_server_restarted_mid_upload() {
    let mut weed = Weed::start("onecopy-restart").expect("start weed mini");
    let o = Arc::new(s3(&weed, "s", Duration::from_secs(60)));
    ready(&*o);
    let before = Bytes::from(vec![7u8; 3 << 20]);
    o.put_new("before", before.clone()).unwrap();
    weed.kill();
    let big = Bytes::from(
        (0..(8u32 << 20))
            .map(|i| (i % 251) as u8)
            .collect::<Vec<_>>(),
    );
    let put = {
        let (o, big) = (o.clone(), big.clone());
        std::thread::spawn(move || o.put_new("during", big))
    };
    std::thread::sleep(Duration::from_secs(2));
    weed.restart().unwrap();
    put.join().unwrap().unwrap();
    assert_eq!(o.get("during").unwrap().0, big);
    assert_eq!(o.get("before").unwrap().0, before);
}

/// A server that stays down: the call fails within its patience with a
/// remote error naming the key, and does not hang.
#[test]
fn s3_server_down_is_an_error() {
    let mut weed = Weed::start("onecopy-down").expect("start weed mini");
    let o = s3(&weed, "s", Duration::from_secs(3));
    ready(&o);
    weed.kill();
    let t0 = std::time::Instant::now();
    let e = o.put_new("x", Bytes::from_static(b"x")).unwrap_err();
    assert!(matches!(e, ObjectError::Remote { .. }), "{e}");
    assert!(e.to_string().contains("x"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
}
