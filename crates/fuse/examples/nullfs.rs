//! Mounts the null filesystem (writes discarded) on the same FUSE crate and
//! settings as the store: the FUSE ceiling in bench/store.sh.
//! Usage: nullfs MOUNTPOINT [THREADS] (foreground; unmount with
//! fusermount3 -u). THREADS defaults to the store mount's default.

fn main() {
    let mut args = std::env::args_os().skip(1);
    let Some(mnt) = args.next() else {
        eprintln!("usage: nullfs MOUNTPOINT [THREADS]");
        std::process::exit(2);
    };
    let threads = match args.next().map(|t| t.to_string_lossy().parse::<usize>()) {
        None => onecopy_fuse::default_threads(),
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("nullfs: THREADS must be a positive number");
            std::process::exit(2);
        }
    };
    let config = onecopy_fuse::mount_config("onecopy-null", threads);
    if let Err(e) = onecopy_fuse::serve(onecopy_fuse::NullFs::default(), mnt.as_ref(), &config) {
        eprintln!("nullfs: {e}");
        std::process::exit(3);
    }
}
