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
        Arc::new(Tiered::new(local, objects.clone(), u64::MAX))
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
