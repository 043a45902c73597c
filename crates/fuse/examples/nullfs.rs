//! Mounts the null filesystem (writes discarded) on the same FUSE crate and
//! settings as the store: the FUSE ceiling in bench/store.sh.
//! Usage: nullfs MOUNTPOINT (foreground; unmount with fusermount3 -u).

fn main() {
    let Some(mnt) = std::env::args_os().nth(1) else {
        eprintln!("usage: nullfs MOUNTPOINT");
        std::process::exit(2);
    };
    let config = onecopy_fuse::mount_config("onecopy-null", 4);
    if let Err(e) = onecopy_fuse::serve(onecopy_fuse::NullFs::default(), mnt.as_ref(), &config) {
        eprintln!("nullfs: {e}");
        std::process::exit(3);
    }
}
