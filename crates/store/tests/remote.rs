//! A store whose sealed containers live in a real S3 server (SeaweedFS
//! `weed mini`, started here; the test fails if it cannot start). The
//! server is killed while containers wait to be uploaded and started
//! again; the local copies are then deleted and every byte must come
//! back from the bucket.

use std::sync::Arc;
use std::time::Duration;

use onecopy_objects::{Objects, S3Config, S3Objects};
use onecopy_store::container::{ContainerStore, LocalDir};
use onecopy_store::remote::{object_key, Tiered};
use onecopy_store::{Kind, NewNode, Store, StoreConfig};
use onecopy_testfs::{random_bytes, Weed};

fn bucket(weed: &Weed) -> Arc<dyn Objects> {
    weed.export_env();
    let mut c = S3Config::from_url(&format!("s3://{}/store", weed.bucket)).unwrap();
    c.endpoint = Some(weed.endpoint.clone());
    c.patience = Duration::from_secs(2);
    let o = S3Objects::new(&c).unwrap();
    let t0 = std::time::Instant::now();
    while let Err(e) = o.list("") {
        assert!(t0.elapsed() < Duration::from_secs(60), "S3 not ready: {e}");
        std::thread::sleep(Duration::from_millis(200));
    }
    Arc::new(o)
}

fn write(s: &Store, name: &str, data: &[u8]) -> u64 {
    let a = s
        .mknod(1, name.as_bytes(), NewNode::root_owned(Kind::File, 0o644))
        .unwrap();
    s.open_file(a.ino).unwrap();
    for (i, piece) in data.chunks(1 << 20).enumerate() {
        s.write(a.ino, (i << 20) as u64, piece).unwrap();
    }
    s.release_file(a.ino).unwrap();
    a.ino
}

#[test]
fn containers_uploaded_across_a_server_crash_read_back_from_the_bucket() {
    let mut weed = Weed::start("onecopy-store").expect("start weed mini");
    let objects = bucket(&weed);
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        chunking: "fixed:64K".parse().unwrap(),
        compress: "none".parse().unwrap(),
        container_size: 1 << 20,
        ..StoreConfig::default()
    };
    Store::init(dir.path(), &cfg).unwrap();
    let tiered = || {
        let local = LocalDir::new(dir.path().join("containers"));
        Arc::new(Tiered::new(local, objects.clone(), u64::MAX).unwrap())
    };
    let t = tiered();
    let s = Store::open_with(dir.path(), t.clone()).unwrap();
    let first = random_bytes(3 << 20, 1);
    let a = write(&s, "first", &first);
    s.commit(true).unwrap();
    t.wait_uploaded(Duration::from_secs(60)).unwrap();

    // The server dies; writes go on (containers are local first) and
    // their uploads wait.
    weed.kill();
    let second = random_bytes(4 << 20, 2);
    let b = write(&s, "second", &second);
    s.commit(true).unwrap();
    let e = t.wait_uploaded(Duration::from_secs(3)).unwrap_err();
    assert!(e.to_string().contains("not uploaded yet"), "{e}");
    // Unmounted before the server came back: the next open resumes.
    drop(s);
    drop(t);
    weed.restart().unwrap();
    let t = tiered();
    let s = Store::open_with(dir.path(), t.clone()).unwrap();
    t.wait_uploaded(Duration::from_secs(120)).unwrap();
    drop(s);
    drop(t);

    // Every sealed container is in the bucket: delete the local copies.
    let local = LocalDir::new(dir.path().join("containers"));
    let mut gone = 0;
    for id in local.list().unwrap() {
        if objects.size(&object_key(id)).unwrap().is_some() {
            local.delete(id).unwrap();
            gone += 1;
        }
    }
    assert!(gone >= 6, "7 MiB in 1 MiB containers: {gone} uploaded");
    let t = tiered();
    let s = Store::open_with(dir.path(), t.clone()).unwrap();
    assert_eq!(s.read(a, 0, first.len()).unwrap(), first);
    assert_eq!(s.read(b, 0, second.len()).unwrap(), second);
    assert!(s.fsck(false).unwrap().problems.is_empty());
    assert!(s.scrub().unwrap().damaged.is_empty());
}

/// A remote store behind a proxy that answers 20% of requests with 503,
/// loses 10% of answers after the request took effect, delays every
/// answer, and hides every container from listings: files written,
/// pushed, partly deleted and gc'd, pushed again, and the cache deleted
/// and rebuilt from the bucket through the same faults read back whole;
/// fsck and scrub are clean. Nothing lost, nothing invented.
#[test]
fn a_misbehaving_server_loses_nothing() {
    use onecopy_store::bucket::recover;
    use onecopy_store::RemoteSpec;
    use onecopy_testfs::{FaultProxy, Faults};
    let weed = Weed::start("onecopy-faults").expect("start weed mini");
    let _ready = bucket(&weed);
    let proxy = FaultProxy::start(&weed.endpoint).unwrap();
    let spec = RemoteSpec {
        url: format!("s3://{}/faulty", weed.bucket),
        endpoint: Some(proxy.endpoint()),
        region: None,
        cache_size: Some(2 << 20),
        key: None,
        read_only: false,
        grace_secs: None,
        patience_secs: Some(60),
    };
    proxy.set(Faults {
        error_rate: 0.2,
        drop_rate: 0.1,
        delay: Duration::from_millis(5),
        hide_in_listings: Some("data/".into()),
    });
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        chunking: "fixed:64K".parse().unwrap(),
        compress: "none".parse().unwrap(),
        container_size: 1 << 20,
        remote: Some(spec.clone()),
        ..StoreConfig::default()
    };
    Store::init_with(dir.path(), &cfg, Some(b"pw")).unwrap();
    let s = Store::open(dir.path()).unwrap();
    let datas: Vec<Vec<u8>> = (0..5).map(|i| random_bytes(1 << 20, 100 + i)).collect();
    let mut inos = Vec::new();
    for (i, d) in datas.iter().enumerate() {
        inos.push(write(&s, &format!("f{i}"), d));
        if i % 2 == 1 {
            s.push_remote().unwrap();
        }
    }
    s.unlink(1, b"f0").unwrap();
    s.gc().unwrap();
    s.push_remote().unwrap();
    drop(s);
    let counts = proxy.counts();
    eprintln!("requests through the proxy: {counts:?}");
    assert!(counts.get("PUT").copied().unwrap_or(0) >= 8, "{counts:?}");

    let d2 = tempfile::tempdir().unwrap();
    let cache = d2.path().join("cache");
    recover(&cache, &spec, Some(b"pw"), false).unwrap();
    let s = Store::open(&cache).unwrap();
    assert!(s.lookup(1, b"f0").is_err(), "a deleted file came back");
    for (ino, d) in inos.iter().zip(&datas).skip(1) {
        assert_eq!(&s.read(*ino, 0, d.len()).unwrap(), d);
    }
    assert!(s.fsck(false).unwrap().problems.is_empty());
    assert!(s.scrub().unwrap().damaged.is_empty());
}

/// The server down during a push: the push fails within its patience and
/// says so, the store goes on locally, and the next push once the server
/// is back brings the bucket up to date (a cache rebuilt from it holds
/// the file written while the server was down).
#[test]
fn a_push_while_the_server_is_down_fails_and_the_next_one_catches_up() {
    use onecopy_store::bucket::recover;
    use onecopy_store::RemoteSpec;
    let mut weed = Weed::start("onecopy-down").expect("start weed mini");
    let _ready = bucket(&weed);
    let spec = RemoteSpec {
        url: format!("s3://{}/down", weed.bucket),
        endpoint: Some(weed.endpoint.clone()),
        region: None,
        cache_size: None,
        key: None,
        read_only: false,
        grace_secs: None,
        patience_secs: Some(3),
    };
    let dir = tempfile::tempdir().unwrap();
    let cfg = StoreConfig {
        container_size: 1 << 20,
        remote: Some(spec.clone()),
        ..StoreConfig::default()
    };
    Store::init_with(dir.path(), &cfg, Some(b"pw")).unwrap();
    let s = Store::open(dir.path()).unwrap();
    weed.kill();
    let data = random_bytes(3 << 20, 7);
    let a = write(&s, "while-down", &data);
    let t0 = std::time::Instant::now();
    let e = s.push_remote().unwrap_err();
    eprintln!("push with the server down: {e} (after {:?})", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(120));
    assert_eq!(
        s.read(a, 0, data.len()).unwrap(),
        data,
        "the store goes on locally"
    );
    weed.restart().unwrap();
    let t0 = std::time::Instant::now();
    loop {
        match s.push_remote() {
            Ok(_) => break,
            Err(e) => {
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "no push after restart: {e}"
                );
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
    drop(s);
    let d2 = tempfile::tempdir().unwrap();
    let cache = d2.path().join("cache");
    recover(&cache, &spec, Some(b"pw"), false).unwrap();
    let s = Store::open(&cache).unwrap();
    assert_eq!(s.read(a, 0, data.len()).unwrap(), data);
    assert!(s.fsck(false).unwrap().problems.is_empty());
}
