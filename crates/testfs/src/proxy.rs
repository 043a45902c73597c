//! A fault-injecting HTTP/1.1 proxy to put between an S3 client and a real
//! S3 server ([`crate::Weed`]): it answers some requests with `503 Slow
//! Down`, delays answers, loses answers after the request took effect, and
//! hides objects from listings, as an unreliable object store would.
//!
//! One thread per client connection, one request per connection: every
//! request goes upstream on a new connection with `Connection: close`, and
//! every answer carries `Connection: close` (clients reconnect). Request
//! heads are forwarded unchanged otherwise (SigV4 signatures stay valid,
//! `Host` included). Bodies are buffered in memory: fine for tests.
//!
//! ```no_run
//! use onecopy_testfs::{FaultProxy, Faults, Weed};
//!
//! let weed = Weed::start("bucket").unwrap();
//! let proxy = FaultProxy::start(&weed.endpoint).unwrap();
//! // ... point the client at proxy.endpoint() ...
//! proxy.set(Faults { error_rate: 0.2, ..Faults::default() });
//! // ... the client must retry its way through ...
//! assert!(proxy.count("PUT") > 0);
//! ```

use crate::Prng;
use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Read/write timeout of every socket, so no thread waits forever.
const IO_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest request or response head accepted.
const MAX_HEAD: usize = 64 << 10;
/// Seed of each proxy's fault generator (runs are reproducible).
const SEED: u64 = 0x0C0F_FEE5_0DD5;

/// What the proxy does to requests; changeable while it runs.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Answer this share (0.0..=1.0) of requests with `503 Slow Down` (an
    /// S3 XML error body, `Connection: close`) without forwarding them.
    pub error_rate: f64,
    /// Delay every forwarded request's response by this long.
    pub delay: Duration,
    /// Close the client connection without any answer for this share of
    /// requests (after forwarding them upstream – the request may have
    /// taken effect: a lost answer).
    pub drop_rate: f64,
    /// For requests whose method is GET and whose path+query contains
    /// `list-type=2` (an S3 ListObjectsV2): remove from the response body
    /// every `<Contents>...</Contents>` element whose `<Key>` contains this
    /// substring (a listing that misses recent objects), matched against
    /// the raw XML text of the key. `None`: listings pass unchanged.
    pub hide_in_listings: Option<String>,
}

/// A running proxy; dropping it stops accepting connections.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

/// State shared by the acceptor and the connection threads.
struct Shared {
    upstream: SocketAddr,
    stop: AtomicBool,
    state: Mutex<State>,
}

/// The mutable part of [`Shared`].
struct State {
    faults: Faults,
    rng: Prng,
    counts: BTreeMap<String, u64>,
}

/// What happens to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Forward it and pass the answer back.
    Forward,
    /// Forward it, then close the client connection without an answer.
    Drop,
    /// Answer `503 Slow Down` without forwarding.
    SlowDown,
}

impl FaultProxy {
    /// Listens on 127.0.0.1 (a free port) and forwards to `upstream`
    /// (`"http://127.0.0.1:PORT"`).
    pub fn start(upstream: &str) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream: resolve(upstream)?,
            stop: AtomicBool::new(false),
            state: Mutex::new(State {
                faults: Faults::default(),
                rng: Prng::new(SEED),
                counts: BTreeMap::new(),
            }),
        });
        let s = shared.clone();
        let acceptor = thread::Builder::new()
            .name("faultproxy-accept".into())
            .spawn(move || accept_loop(listener, s))?;
        Ok(FaultProxy {
            addr,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// `"http://127.0.0.1:PORT"` of the proxy.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Replaces the faults applied to requests read from now on.
    pub fn set(&self, f: Faults) {
        self.shared.lock().faults = f;
    }

    /// Requests seen so far by method (`"PUT"`, `"GET"`, `"HEAD"`,
    /// `"DELETE"`, `"POST"`), counting every request the proxy read
    /// (faulted or not).
    pub fn counts(&self) -> BTreeMap<String, u64> {
        self.shared.lock().counts.clone()
    }

    /// Request count of one method.
    pub fn count(&self, method: &str) -> u64 {
        self.shared.lock().counts.get(method).copied().unwrap_or(0)
    }
}

impl Drop for FaultProxy {
    /// Stops the acceptor (waking it with a connection of our own);
    /// connection threads end when their sockets close or time out.
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let woken = TcpStream::connect_timeout(&self.addr, Duration::from_secs(5)).is_ok();
        if let Some(t) = self.acceptor.take() {
            if woken {
                let _ = t.join();
            }
        }
    }
}

impl Shared {
    /// The state, even if a connection thread panicked holding it.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a request of `method` and draws its fate; returns the faults
    /// in force with it.
    fn admit(&self, method: &str) -> (Faults, Fate) {
        let mut st = self.lock();
        *st.counts.entry(method.to_string()).or_insert(0) += 1;
        let (error_rate, drop_rate) = (st.faults.error_rate, st.faults.drop_rate);
        let fate = if st.rng.chance(error_rate) {
            Fate::SlowDown
        } else if st.rng.chance(drop_rate) {
            Fate::Drop
        } else {
            Fate::Forward
        };
        (st.faults.clone(), fate)
    }
}

/// The socket address of `"http://HOST:PORT"` (a trailing `/` allowed).
fn resolve(upstream: &str) -> io::Result<SocketAddr> {
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad upstream {upstream:?}"),
        )
    };
    let hostport = upstream.strip_prefix("http://").ok_or_else(bad)?;
    let hostport = hostport.trim_end_matches('/');
    hostport.to_socket_addrs()?.next().ok_or_else(bad)
}

/// Accepts connections until the proxy is dropped, one thread each.
fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(conn) = conn else { continue };
        let s = shared.clone();
        let _ = thread::Builder::new()
            .name("faultproxy-conn".into())
            .spawn(move || {
                let _ = serve(conn, &s);
            });
    }
}

/// Handles the one request of a client connection, then closes it.
fn serve(mut client: TcpStream, shared: &Shared) -> io::Result<()> {
    client.set_read_timeout(Some(IO_TIMEOUT))?;
    client.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut reader = BufReader::new(client.try_clone()?);
    let Some(mut head) = Head::read(&mut reader)? else {
        return Ok(());
    };
    if head
        .header("expect")
        .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"))
    {
        client.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
    }
    let body = read_body(&mut reader, &head)?;
    let (method, target) = head.request_line();
    let (faults, fate) = shared.admit(&method);
    let answer = match fate {
        Fate::SlowDown => error_response("503 Slow Down", "SlowDown", &method),
        Fate::Drop | Fate::Forward => {
            head.set_header("Connection", "close");
            let answer = match forward(shared.upstream, &head, &body) {
                Ok(raw) => rewrite_response(&raw, &method, &target, &faults)?,
                Err(_) => error_response("502 Bad Gateway", "BadGateway", &method),
            };
            thread::sleep(faults.delay);
            if fate == Fate::Drop {
                return Ok(()); // dropping `client` closes it unanswered
            }
            answer
        }
    };
    client.write_all(&answer)?;
    client.shutdown(Shutdown::Write)
}

/// Sends one request (head and raw body) to `upstream` on a new connection
/// and returns the whole response, read until the server closes.
fn forward(upstream: SocketAddr, head: &Head, body: &[u8]) -> io::Result<Vec<u8>> {
    let mut up = TcpStream::connect_timeout(&upstream, Duration::from_secs(10))?;
    up.set_read_timeout(Some(IO_TIMEOUT))?;
    up.set_write_timeout(Some(IO_TIMEOUT))?;
    // A server may answer (an error) and close before taking the whole
    // body: its answer counts even when sending the rest failed.
    let sent = up
        .write_all(&head.to_bytes())
        .and_then(|()| up.write_all(body));
    let mut raw = Vec::new();
    let read = up.read_to_end(&mut raw);
    match (sent, read) {
        (_, Ok(_)) if !raw.is_empty() => Ok(raw),
        (Err(e), _) | (_, Err(e)) => Err(e),
        (Ok(()), Ok(_)) => Err(io::ErrorKind::UnexpectedEof.into()),
    }
}

/// The request body as it came, framing included: `Content-Length` bytes,
/// or the raw chunks up to and with the last one and its trailers.
fn read_body(r: &mut impl BufRead, head: &Head) -> io::Result<Vec<u8>> {
    if is_chunked(head) {
        return read_chunks(r, true);
    }
    let len = match head.header("content-length") {
        None => 0,
        Some(v) => v
            .parse::<u64>()
            .map_err(|_| invalid("bad Content-Length"))?,
    };
    let mut body = Vec::new();
    r.take(len).read_to_end(&mut body)?;
    if body.len() as u64 != len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(body)
}

/// Whether a message's body is in chunked transfer coding.
fn is_chunked(head: &Head) -> bool {
    head.header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
}

/// Reads a chunked body through its terminating 0-size chunk and trailers.
/// Returns it raw (`keep_framing`) or as the data alone (de-chunked).
fn read_chunks(r: &mut impl BufRead, keep_framing: bool) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line = read_line(r)?;
        let size_text = String::from_utf8_lossy(&line);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| invalid("bad chunk size"))?;
        if keep_framing {
            out.extend_from_slice(&line);
        }
        if size == 0 {
            break;
        }
        let mut data = vec![0; size + 2];
        r.read_exact(&mut data)?;
        let end = if keep_framing { size + 2 } else { size };
        out.extend_from_slice(&data[..end]);
    }
    loop {
        let trailer = read_line(r)?;
        if keep_framing {
            out.extend_from_slice(&trailer);
        }
        if trailer == b"\r\n" || trailer == b"\n" {
            return Ok(out);
        }
    }
}

/// One line, `\n` included; an error at end of input.
fn read_line(r: &mut impl BufRead) -> io::Result<Vec<u8>> {
    let mut line = Vec::new();
    r.take(MAX_HEAD as u64).read_until(b'\n', &mut line)?;
    if !line.ends_with(b"\n") {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(line)
}

/// The response to send the client for the upstream response `raw` to
/// request `method` `target`: interim 1xx responses dropped, `Connection:
/// close` set, and listings filtered as `faults` say.
fn rewrite_response(
    raw: &[u8],
    method: &str,
    target: &str,
    faults: &Faults,
) -> io::Result<Vec<u8>> {
    let mut r = raw;
    let mut head = loop {
        let head = Head::read(&mut r)?.ok_or_else(|| invalid("empty upstream response"))?;
        if !head.status().starts_with('1') {
            break head;
        }
    };
    let mut body = r.to_vec();
    head.set_header("Connection", "close");
    let hide = faults.hide_in_listings.as_deref();
    if let Some(needle) = hide.filter(|_| is_listing(method, target) && head.status() == "200") {
        if is_chunked(&head) {
            body = read_chunks(&mut &body[..], false)?;
            head.remove_header("Transfer-Encoding");
        }
        body = hide_in_listing(&body, needle);
        head.set_header("Content-Length", &body.len().to_string());
    }
    let mut out = head.to_bytes();
    out.extend_from_slice(&body);
    Ok(out)
}

/// Whether a request is an S3 ListObjectsV2.
fn is_listing(method: &str, target: &str) -> bool {
    method == "GET" && target.contains("list-type=2")
}

/// `body` (a ListBucketResult) without the `<Contents>` elements whose
/// `<Key>` contains `needle`, `<KeyCount>` lowered to match. Bodies that
/// are not UTF-8 come back unchanged.
fn hide_in_listing(body: &[u8], needle: &str) -> Vec<u8> {
    const OPEN: &str = "<Contents>";
    const CLOSE: &str = "</Contents>";
    let Ok(mut rest) = std::str::from_utf8(body) else {
        return body.to_vec();
    };
    let mut out = String::with_capacity(rest.len());
    let mut hidden = 0;
    while let Some(start) = rest.find(OPEN) {
        let Some(len) = rest[start..].find(CLOSE) else {
            break;
        };
        let end = start + len + CLOSE.len();
        let element = &rest[start..end];
        out.push_str(&rest[..start]);
        if element_text(element, "Key").is_some_and(|k| k.contains(needle)) {
            hidden += 1;
        } else {
            out.push_str(element);
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    lower_key_count(&out, hidden).into_bytes()
}

/// The text of the first `<tag>` element in `xml`.
fn element_text<'a>(xml: &'a str, tag: &str) -> Option<&'a str> {
    let start = xml.find(&format!("<{tag}>"))? + tag.len() + 2;
    let len = xml[start..].find(&format!("</{tag}>"))?;
    Some(&xml[start..start + len])
}

/// `xml` with its `<KeyCount>` (if any) lowered by `hidden`.
fn lower_key_count(xml: &str, hidden: u64) -> String {
    let Some(text) = element_text(xml, "KeyCount").filter(|_| hidden > 0) else {
        return xml.to_string();
    };
    let Ok(n) = text.trim().parse::<u64>() else {
        return xml.to_string();
    };
    let old = format!("<KeyCount>{text}</KeyCount>");
    let new = format!("<KeyCount>{}</KeyCount>", n.saturating_sub(hidden));
    xml.replacen(&old, &new, 1)
}

/// A complete S3-style error response (`status` like `"503 Slow Down"`),
/// with `Connection: close`; no body for HEAD requests.
fn error_response(status: &str, code: &str, method: &str) -> Vec<u8> {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
         <Message>Injected by onecopy-testfs FaultProxy</Message>\
         <RequestId>faultproxy</RequestId></Error>"
    );
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    if method != "HEAD" {
        out.push_str(&body);
    }
    out.into_bytes()
}

/// An `InvalidData` error.
fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

/// An HTTP/1.1 message head: start line and header lines, raw bytes
/// without line ends.
#[derive(Debug)]
struct Head {
    lines: Vec<Vec<u8>>,
}

impl Head {
    /// Reads a head up to its empty line; `None` at a clean end of input.
    fn read(r: &mut impl BufRead) -> io::Result<Option<Head>> {
        let mut lines: Vec<Vec<u8>> = Vec::new();
        let mut total = 0;
        loop {
            let mut line = Vec::new();
            let n = r.take(MAX_HEAD as u64).read_until(b'\n', &mut line)?;
            total += n;
            if n == 0 && lines.is_empty() {
                return Ok(None);
            }
            if n == 0 || total > MAX_HEAD {
                return Err(invalid("truncated or oversized HTTP head"));
            }
            while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                line.pop();
            }
            match (line.is_empty(), lines.is_empty()) {
                (true, true) => continue, // stray blank line before a message
                (true, false) => return Ok(Some(Head { lines })),
                (false, _) => lines.push(line),
            }
        }
    }

    /// The request's method and target (path and query).
    fn request_line(&self) -> (String, String) {
        let start = String::from_utf8_lossy(&self.lines[0]).into_owned();
        let mut words = start.split_whitespace();
        let method = words.next().unwrap_or("").to_string();
        (method, words.next().unwrap_or("").to_string())
    }

    /// A response's status code (`"200"`).
    fn status(&self) -> String {
        let start = String::from_utf8_lossy(&self.lines[0]).into_owned();
        start.split_whitespace().nth(1).unwrap_or("").to_string()
    }

    /// The (first) value of header `name`, trimmed; case-insensitive.
    fn header(&self, name: &str) -> Option<String> {
        self.lines[1..].iter().find_map(|line| {
            let (n, v) = split_header(line)?;
            n.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }

    /// Removes every header `name` (case-insensitive).
    fn remove_header(&mut self, name: &str) {
        let start = self.lines.remove(0);
        self.lines
            .retain(|line| !split_header(line).is_some_and(|(n, _)| n.eq_ignore_ascii_case(name)));
        self.lines.insert(0, start);
    }

    /// Sets header `name` to `value`, replacing any previous ones.
    fn set_header(&mut self, name: &str, value: &str) {
        self.remove_header(name);
        self.lines.push(format!("{name}: {value}").into_bytes());
    }

    /// The head as sent on the wire, with its final empty line.
    fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for line in &self.lines {
            out.extend_from_slice(line);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out
    }
}

/// A header line's name (trimmed) and raw value.
fn split_header(line: &[u8]) -> Option<(String, String)> {
    let colon = line.iter().position(|b| *b == b':')?;
    let name = String::from_utf8_lossy(&line[..colon]).trim().to_string();
    Some((
        name,
        String::from_utf8_lossy(&line[colon + 1..]).into_owned(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LISTING: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n\
        <ListBucketResult><Name>b</Name><KeyCount>3</KeyCount>\
        <Contents><Key>a/new1</Key><Size>1</Size></Contents>\
        <Contents><Key>a/old</Key><Size>2</Size></Contents>\
        <Contents><Key>a/new2</Key><Size>3</Size></Contents>\
        <IsTruncated>false</IsTruncated></ListBucketResult>";

    const KEPT: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n\
        <ListBucketResult><Name>b</Name><KeyCount>1</KeyCount>\
        <Contents><Key>a/old</Key><Size>2</Size></Contents>\
        <IsTruncated>false</IsTruncated></ListBucketResult>";

    fn hiding(needle: &str) -> Faults {
        Faults {
            hide_in_listings: Some(needle.into()),
            ..Faults::default()
        }
    }

    #[test]
    fn listing_filter_keeps_only_unmatched_keys() {
        let out = hide_in_listing(LISTING.as_bytes(), "new");
        assert_eq!(String::from_utf8(out).unwrap(), KEPT);
    }

    #[test]
    fn listing_filter_without_match_is_identity() {
        let out = hide_in_listing(LISTING.as_bytes(), "zzz");
        assert_eq!(String::from_utf8(out).unwrap(), LISTING);
    }

    #[test]
    fn listing_response_gets_new_content_length() {
        let raw = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Type: application/xml\r\n\r\n{LISTING}",
            LISTING.len()
        );
        let out = rewrite_response(
            raw.as_bytes(),
            "GET",
            "/b?list-type=2&prefix=a",
            &hiding("new"),
        );
        let want = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nConnection: close\r\n\
             Content-Length: {}\r\n\r\n{KEPT}",
            KEPT.len()
        );
        assert_eq!(String::from_utf8(out.unwrap()).unwrap(), want);
    }

    #[test]
    fn chunked_listing_response_is_dechunked() {
        let (a, b) = LISTING.split_at(100);
        let raw = format!(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x};x=y\r\n{b}\r\n0\r\n\r\n",
            a.len(),
            b.len()
        );
        let out = rewrite_response(raw.as_bytes(), "GET", "/b?list-type=2", &hiding("new"));
        let want = format!(
            "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{KEPT}",
            KEPT.len()
        );
        assert_eq!(String::from_utf8(out.unwrap()).unwrap(), want);
    }

    #[test]
    fn other_responses_pass_unchanged_but_for_connection() {
        let raw = format!(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nConnection: keep-alive\r\n\
             Content-Length: {}\r\n\r\n{LISTING}",
            LISTING.len()
        );
        let want = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{LISTING}",
            LISTING.len()
        );
        let cases = [
            ("GET", "/b/a/new1", hiding("new")),
            ("HEAD", "/b?list-type=2", hiding("new")),
            ("GET", "/b?list-type=2", Faults::default()),
        ];
        for (method, target, faults) in cases {
            let out = rewrite_response(raw.as_bytes(), method, target, &faults).unwrap();
            assert_eq!(String::from_utf8(out).unwrap(), want, "{method} {target}");
        }
    }

    #[test]
    fn chunked_request_body_is_read_raw() {
        let wire = b"4\r\nabcd\r\n0\r\nx-amz-checksum-crc32: AAAAAA==\r\n\r\nNEXT";
        let mut r = &wire[..];
        let body = read_chunks(&mut r, true).unwrap();
        assert_eq!(body, &wire[..wire.len() - 4]);
        assert_eq!(r, b"NEXT");
    }

    #[test]
    fn head_header_edits_are_case_insensitive() {
        let mut r = &b"GET /b/k?x=1 HTTP/1.1\r\nHost: h\r\nconnection: keep-alive\r\n\r\n"[..];
        let mut head = Head::read(&mut r).unwrap().unwrap();
        assert_eq!(head.request_line(), ("GET".into(), "/b/k?x=1".into()));
        head.set_header("Connection", "close");
        assert_eq!(head.header("CONNECTION").as_deref(), Some("close"));
        assert_eq!(
            head.to_bytes(),
            b"GET /b/k?x=1 HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
        );
    }
}
