//! The fault-injecting proxy in front of a real SeaweedFS. Requests here are
//! unsigned (the server answers them `403 AccessDenied`), which is enough to
//! see what the proxy forwards, answers itself, delays and drops. Needs the
//! `weed` binary: without it these tests fail.

use onecopy_testfs::{FaultProxy, Faults, Weed};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// A running server with a proxy in front of it.
fn setup() -> (Weed, FaultProxy) {
    let weed = Weed::start("proxytest").expect("starting weed mini");
    // The port answers before the bucket exists (404 NoSuchBucket until
    // then): wait for the steady answer to an unsigned request, 403.
    let t0 = std::time::Instant::now();
    loop {
        let probe = request("GET", "/proxytest/k?list-type=2", "close");
        match exchange(&weed.endpoint, &probe) {
            Ok(a) if status(&a) == "HTTP/1.1 403 Forbidden" => break,
            r => assert!(
                t0.elapsed() < Duration::from_secs(60),
                "weed not ready: {:?}",
                r.map(|a| status(&a).to_string())
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let proxy = FaultProxy::start(&weed.endpoint).expect("starting the proxy");
    (weed, proxy)
}

/// Sends `request` (raw) to `endpoint` and returns all it answers until it
/// closes the connection.
fn exchange(endpoint: &str, request: &[u8]) -> io::Result<Vec<u8>> {
    let mut conn = TcpStream::connect(endpoint.trim_start_matches("http://"))?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))?;
    conn.write_all(request)?;
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer)?;
    Ok(answer)
}

/// A request without body, with header `Connection: {connection}`
/// (`keep-alive` to the proxy, which must close anyway; `close` to the server).
fn request(method: &str, path: &str, connection: &str) -> Vec<u8> {
    format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: {connection}\r\n\r\n")
        .into_bytes()
}

/// The status line of a raw response.
fn status(answer: &[u8]) -> String {
    let text = String::from_utf8_lossy(answer);
    text.lines().next().unwrap_or("").to_string()
}

/// The value of header `name` in a raw response (case-insensitive).
fn header(answer: &[u8], name: &str) -> Option<String> {
    let text = String::from_utf8_lossy(answer);
    let head = text.split("\r\n\r\n").next().unwrap_or("");
    head.lines().skip(1).find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_string())
    })
}

/// The body of a raw response.
fn body(answer: &[u8]) -> &[u8] {
    let at = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no head end");
    &answer[at + 4..]
}

#[test]
fn forwards_requests_and_counts_them() {
    let (weed, proxy) = setup();
    let get = |c| request("GET", "/proxytest/k?list-type=2", c);
    let direct = exchange(&weed.endpoint, &get("close")).unwrap();
    let proxied = exchange(&proxy.endpoint(), &get("keep-alive")).unwrap();
    assert_eq!(status(&direct), "HTTP/1.1 403 Forbidden");
    assert_eq!(status(&proxied), status(&direct));
    assert_eq!(header(&proxied, "connection").as_deref(), Some("close"));
    assert!(String::from_utf8_lossy(body(&proxied)).contains("<Code>AccessDenied</Code>"));
    assert_eq!(
        header(&proxied, "content-length").unwrap(),
        body(&proxied).len().to_string()
    );

    let head = |c| request("HEAD", "/proxytest/k", c);
    let direct = exchange(&weed.endpoint, &head("close")).unwrap();
    let proxied = exchange(&proxy.endpoint(), &head("keep-alive")).unwrap();
    assert_eq!(status(&proxied), status(&direct));
    assert_eq!(
        header(&proxied, "content-length"),
        header(&direct, "content-length")
    );
    assert!(body(&proxied).is_empty(), "a body after a HEAD answer");

    for method in ["PUT", "DELETE", "POST"] {
        let direct = exchange(&weed.endpoint, &request(method, "/proxytest/k", "close")).unwrap();
        let proxied = exchange(
            &proxy.endpoint(),
            &request(method, "/proxytest/k", "keep-alive"),
        );
        assert_eq!(status(&proxied.unwrap()), status(&direct), "{method}");
    }
    let counts = proxy.counts();
    let want = [
        ("DELETE", 1),
        ("GET", 1),
        ("HEAD", 1),
        ("POST", 1),
        ("PUT", 1),
    ];
    let want = want.iter().map(|(m, n)| (m.to_string(), *n)).collect();
    assert_eq!(counts, want);
    assert_eq!(proxy.count("GET"), 1);
    assert_eq!(proxy.count("PATCH"), 0);
}

#[test]
fn forwards_request_bodies() {
    let (weed, proxy) = setup();
    let sized = b"PUT /proxytest/k HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\nhello";
    let chunked =
        b"PUT /proxytest/k HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n\
        5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n";
    for request in [&sized[..], &chunked[..]] {
        let proxied = exchange(&proxy.endpoint(), request).unwrap();
        assert_eq!(status(&proxied), "HTTP/1.1 403 Forbidden");
    }
    assert_eq!(proxy.count("PUT"), 2);

    // `Expect: 100-continue`: the proxy invites the body itself.
    let mut conn = TcpStream::connect(proxy.endpoint().trim_start_matches("http://")).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let head = "PUT /proxytest/k HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n";
    conn.write_all(head.as_bytes()).unwrap();
    let mut interim = [0; 25];
    conn.read_exact(&mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    conn.write_all(b"hello").unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).unwrap();
    assert_eq!(status(&answer), "HTTP/1.1 403 Forbidden");
    drop(weed);
}

#[test]
fn injects_errors_drops_and_delays() {
    let (_weed, inner) = setup();
    // An outer proxy in front of `inner`: `inner` counts what got through.
    let outer = FaultProxy::start(&inner.endpoint()).unwrap();
    let get = request("GET", "/proxytest/k", "keep-alive");

    outer.set(Faults {
        error_rate: 1.0,
        ..Faults::default()
    });
    for _ in 0..3 {
        let answer = exchange(&outer.endpoint(), &get).unwrap();
        assert_eq!(status(&answer), "HTTP/1.1 503 Slow Down");
        assert_eq!(header(&answer, "connection").as_deref(), Some("close"));
        assert!(String::from_utf8_lossy(body(&answer)).contains("<Code>SlowDown</Code>"));
    }
    let answer = exchange(&outer.endpoint(), &request("HEAD", "/proxytest/k", "close")).unwrap();
    assert_eq!(status(&answer), "HTTP/1.1 503 Slow Down");
    assert!(body(&answer).is_empty(), "a body after a HEAD answer");
    assert_eq!((outer.count("GET"), outer.count("HEAD")), (3, 1));
    assert!(
        inner.counts().is_empty(),
        "errors went upstream: {:?}",
        inner.counts()
    );

    outer.set(Faults {
        drop_rate: 1.0,
        ..Faults::default()
    });
    let answer = exchange(&outer.endpoint(), &get).unwrap();
    assert!(
        answer.is_empty(),
        "an answer to a dropped request: {answer:?}"
    );
    assert_eq!(
        inner.count("GET"),
        1,
        "a dropped request must reach upstream"
    );

    let delay = Duration::from_millis(300);
    outer.set(Faults {
        delay,
        ..Faults::default()
    });
    let t0 = Instant::now();
    let answer = exchange(&outer.endpoint(), &get).unwrap();
    assert!(t0.elapsed() >= delay, "answered after {:?}", t0.elapsed());
    assert_eq!(status(&answer), "HTTP/1.1 403 Forbidden");

    outer.set(Faults::default());
    let answer = exchange(&outer.endpoint(), &get).unwrap();
    assert_eq!(status(&answer), "HTTP/1.1 403 Forbidden");
    assert_eq!((outer.count("GET"), inner.count("GET")), (6, 3));

    outer.set(Faults {
        error_rate: 0.5,
        ..Faults::default()
    });
    let errors = (0..40)
        .filter(|_| status(&exchange(&outer.endpoint(), &get).unwrap()).contains("503"))
        .count();
    assert!(
        (8..=32).contains(&errors),
        "{errors} of 40 answered 503 at rate 0.5"
    );
    assert_eq!(inner.count("GET"), 3 + 40 - errors as u64);
}

#[test]
fn drop_does_not_hang_on_idle_connections() {
    // Nothing needs to listen upstream for this.
    let proxy = FaultProxy::start("http://127.0.0.1:9").unwrap();
    let endpoint = proxy.endpoint();
    let idle = TcpStream::connect(endpoint.trim_start_matches("http://")).unwrap();
    let t0 = Instant::now();
    drop(proxy);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "drop took {:?}",
        t0.elapsed()
    );
    assert!(
        exchange(&endpoint, &request("GET", "/", "close")).is_err(),
        "still listening"
    );
    drop(idle);
}
