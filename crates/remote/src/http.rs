//! HTTP range reads with retries, and the checks that keep a changed or misbehaving server
//! from ever handing back wrong bytes.
//!
//! A `Remote` is one file at a URL, with the length and validator (ETag, else Last-Modified)
//! its first response gave. Every range read sends the validator as a precondition
//! (`If-Match`, or `If-Unmodified-Since`) and checks what comes back: status 206, a
//! `Content-Range` naming exactly the bytes asked for and the same total length, the same
//! ETag, and a body of exactly that many bytes. A 5xx, 429, timeout, reset or short body is
//! retried with exponential backoff; a 412 (the file changed), 4xx, or a server that ignores
//! ranges is an error naming the URL and the range, at once.

use crate::s3::S3Auth;
use reqwest::blocking::{Client, RequestBuilder, Response};
use reqwest::header::{HeaderMap, CONTENT_RANGE, ETAG, IF_MATCH, IF_UNMODIFIED_SINCE, LAST_MODIFIED, RANGE};
use reqwest::StatusCode;
use std::io::{self, Read};
use std::time::Duration;

/// How a changed remote file is recognised.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Validator {
    ETag(String),
    LastModified(String),
    /// The server gives neither: only the length is checked.
    None,
}

impl Validator {
    pub fn describe(&self) -> String {
        match self {
            Validator::ETag(e) => format!("ETag {e}"),
            Validator::LastModified(m) => format!("Last-Modified {m}"),
            Validator::None => "no ETag or Last-Modified".into(),
        }
    }
}

/// One remote file as its server described it when it was opened.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Remote {
    pub url: String,
    pub len: u64,
    pub validator: Validator,
}

#[derive(Clone, Debug)]
pub struct Retry {
    /// Tries of one request, the first included.
    pub attempts: u32,
    /// The wait before the second try; doubled after each failure, at most `max_wait`.
    pub first_wait: Duration,
    pub max_wait: Duration,
}

impl Default for Retry {
    fn default() -> Self {
        Retry { attempts: 8, first_wait: Duration::from_millis(100), max_wait: Duration::from_secs(5) }
    }
}

#[derive(Clone, Debug)]
pub struct HttpOptions {
    pub retry: Retry,
    /// Connecting, and each whole request, give up after this long (then retry).
    pub timeout: Duration,
    /// Credentials that sign every request (an S3-compatible endpoint).
    pub s3: Option<S3Auth>,
    /// A bearer token and the hosts it is sent to (a host, or a subdomain of it); never to
    /// others, and (the client's rule) not along a redirect to another origin.
    pub bearer: Option<(String, Vec<String>)>,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions { retry: Retry::default(), timeout: Duration::from_secs(30), s3: None, bearer: None }
    }
}

impl HttpOptions {
    /// The defaults, with Hugging Face's token (`HF_TOKEN`, else `HUGGING_FACE_HUB_TOKEN`) for
    /// its hosts, as its own tools send it (gated and private repositories need it).
    pub fn from_env() -> HttpOptions {
        let token =
            ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"].iter().find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()));
        HttpOptions {
            bearer: token.map(|t| (t, vec!["huggingface.co".to_string(), "hf.co".to_string()])),
            ..HttpOptions::default()
        }
    }

    /// The bearer token for `url`, if its host is one the token is for.
    fn bearer_for(&self, url: &str) -> Option<&str> {
        let (token, hosts) = self.bearer.as_ref()?;
        let host = reqwest::Url::parse(url).ok()?.host_str()?.to_ascii_lowercase();
        hosts.iter().any(|h| host == *h || host.ends_with(&format!(".{h}"))).then_some(token.as_str())
    }
}

/// What one try came to.
enum Failure {
    /// Worth trying again (server error, timeout, reset, short body).
    Transient(String),
    /// Trying again cannot help (the file changed, not found, no range support).
    Fatal(String),
}

/// A pooled client (connections are reused; HTTP/2 where the server offers it over TLS).
/// Certificates are checked against the system's roots (and `SSL_CERT_FILE` / `SSL_CERT_DIR`
/// where set) and Mozilla's.
pub struct Http {
    client: Client,
    opts: HttpOptions,
    /// The protocol of the last answer (HTTP/1.1, HTTP/2.0).
    protocol: std::sync::Mutex<Option<String>>,
}

impl Http {
    pub fn new(opts: HttpOptions) -> io::Result<Http> {
        let client = Client::builder()
            .connect_timeout(opts.timeout)
            .timeout(opts.timeout)
            .pool_max_idle_per_host(64)
            .user_agent(concat!("sluice/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| io::Error::other(format!("starting the HTTP client: {e}")))?;
        Ok(Http { client, opts, protocol: std::sync::Mutex::new(None) })
    }

    /// The protocol the server answered with last (`HTTP/2.0` where it offered HTTP/2).
    pub fn protocol(&self) -> Option<String> {
        self.protocol.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn request(&self, method: reqwest::Method, url: &str, headers: HeaderMap) -> RequestBuilder {
        let mut b = self.client.request(method.clone(), url).headers(headers.clone());
        if let Some(t) = self.opts.bearer_for(url) {
            b = b.bearer_auth(t);
        }
        match &self.opts.s3 {
            Some(auth) => b.headers(auth.sign(method.as_str(), url, &headers)),
            None => b,
        }
    }

    /// Runs `once` until it succeeds, fails for good, or runs out of tries.
    fn with_retries<T>(&self, what: &str, mut once: impl FnMut() -> Result<T, Failure>) -> io::Result<T> {
        let r = &self.opts.retry;
        let mut wait = r.first_wait;
        let mut last = String::new();
        for attempt in 0..r.attempts.max(1) {
            if attempt > 0 {
                std::thread::sleep(wait);
                wait = (wait * 2).min(r.max_wait);
            }
            match once() {
                Ok(v) => return Ok(v),
                Err(Failure::Fatal(m)) => return Err(io::Error::other(format!("{what}: {m}"))),
                Err(Failure::Transient(m)) => last = m,
            }
        }
        Err(io::Error::other(format!("{what}: {last} (gave up after {} tries)", r.attempts.max(1))))
    }

    /// Asks the server for the file's length and validator, reading its first byte.
    pub fn open(&self, url: &str) -> io::Result<Remote> {
        self.with_retries(&format!("opening {url}"), || {
            let mut h = HeaderMap::new();
            h.insert(RANGE, "bytes=0-0".parse().expect("header"));
            let resp = self.request(reqwest::Method::GET, url, h).send().map_err(transport)?;
            *self.protocol.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!("{:?}", resp.version()));
            let status = resp.status();
            check_status(status)?;
            let validator = validator_of(resp.headers());
            let len = match status {
                StatusCode::PARTIAL_CONTENT => {
                    let (_, _, total) = content_range(resp.headers())?;
                    total
                }
                StatusCode::OK => {
                    return Err(Failure::Fatal(
                        "the server does not serve byte ranges (it answered a range request with the whole file)"
                            .into(),
                    ))
                }
                s => return Err(Failure::Fatal(format!("unexpected status {s}"))),
            };
            Ok(Remote { url: url.to_string(), len, validator })
        })
    }

    /// Reads `dst.len()` bytes at `offset` of `r` (fewer only where the file ends).
    pub fn read_at(&self, r: &Remote, offset: u64, dst: &mut [u8]) -> io::Result<usize> {
        if offset >= r.len || dst.is_empty() {
            return Ok(0);
        }
        let want = (dst.len() as u64).min(r.len - offset) as usize;
        let last = offset + want as u64 - 1;
        let what = format!("reading bytes {offset}-{last} of {}", r.url);
        self.with_retries(&what, || {
            let mut h = HeaderMap::new();
            h.insert(RANGE, format!("bytes={offset}-{last}").parse().expect("header"));
            match &r.validator {
                Validator::ETag(e) if !e.starts_with("W/") => {
                    h.insert(IF_MATCH, e.parse().map_err(|_| Failure::Fatal(format!("unusable ETag {e}")))?);
                }
                Validator::LastModified(m) => {
                    h.insert(IF_UNMODIFIED_SINCE, m.parse().map_err(|_| Failure::Fatal(format!("bad date {m}")))?);
                }
                _ => {}
            }
            let mut resp = self.request(reqwest::Method::GET, &r.url, h).send().map_err(transport)?;
            check_status(resp.status())?;
            if resp.status() != StatusCode::PARTIAL_CONTENT {
                return Err(Failure::Fatal(format!(
                    "the server answered a range request with status {} instead of 206",
                    resp.status()
                )));
            }
            let now = validator_of(resp.headers());
            if let (Validator::ETag(was), Validator::ETag(is)) = (&r.validator, &now) {
                if was != is {
                    return Err(changed(r, &now));
                }
            }
            let (a, b, total) = content_range(resp.headers())?;
            if total != r.len {
                return Err(Failure::Fatal(format!(
                    "the file changed underneath: it was {} bytes, the server now says {total}",
                    r.len
                )));
            }
            if (a, b) != (offset, last) {
                return Err(Failure::Fatal(format!("the server sent bytes {a}-{b} instead")));
            }
            read_body(&mut resp, &mut dst[..want])?;
            Ok(want)
        })
    }

    /// A whole small file (a config or tokenizer beside the weights); `Ok(None)` on 404.
    pub fn get_small(&self, url: &str) -> io::Result<Option<Vec<u8>>> {
        self.with_retries(&format!("fetching {url}"), || {
            let resp = self.request(reqwest::Method::GET, url, HeaderMap::new()).send().map_err(transport)?;
            if resp.status() == StatusCode::NOT_FOUND {
                return Ok(None);
            }
            check_status(resp.status())?;
            let expect = resp.content_length();
            let body = resp.bytes().map_err(|e| Failure::Transient(format!("reading the body: {e}")))?;
            if expect.is_some_and(|n| n != body.len() as u64) {
                return Err(Failure::Transient(format!("the body ended after {} bytes", body.len())));
            }
            Ok(Some(body.to_vec()))
        })
    }
}

fn changed(r: &Remote, now: &Validator) -> Failure {
    Failure::Fatal(format!(
        "the file changed underneath ({} when opened, {} now); start again to use the new file",
        r.validator.describe(),
        now.describe()
    ))
}

fn transport(e: reqwest::Error) -> Failure {
    let m = format!("{e}{}", source_chain(&e));
    // A certificate the client does not trust will not become trusted by trying again.
    if m.to_lowercase().contains("certificate") {
        Failure::Fatal(m)
    } else {
        Failure::Transient(m)
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = String::new();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(&format!(": {c}"));
        cur = c.source();
    }
    s
}

fn check_status(s: StatusCode) -> Result<(), Failure> {
    if s.is_success() {
        Ok(())
    } else if s == StatusCode::PRECONDITION_FAILED {
        Err(Failure::Fatal("the file changed underneath (the server refused the validator it gave before); start again to use the new file".into()))
    } else if s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS || s == StatusCode::REQUEST_TIMEOUT {
        Err(Failure::Transient(format!("status {s}")))
    } else {
        Err(Failure::Fatal(format!("status {s}")))
    }
}

fn validator_of(h: &HeaderMap) -> Validator {
    if let Some(e) = h.get(ETAG).and_then(|v| v.to_str().ok()) {
        Validator::ETag(e.to_string())
    } else if let Some(m) = h.get(LAST_MODIFIED).and_then(|v| v.to_str().ok()) {
        Validator::LastModified(m.to_string())
    } else {
        Validator::None
    }
}

/// `Content-Range: bytes A-B/TOTAL`.
fn content_range(h: &HeaderMap) -> Result<(u64, u64, u64), Failure> {
    let v = h
        .get(CONTENT_RANGE)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| Failure::Fatal("a 206 response without Content-Range".into()))?;
    let bad = || Failure::Fatal(format!("unreadable Content-Range `{v}`"));
    let rest = v.strip_prefix("bytes ").ok_or_else(bad)?;
    let (range, total) = rest.split_once('/').ok_or_else(bad)?;
    let (a, b) = range.split_once('-').ok_or_else(bad)?;
    let p = |s: &str| s.trim().parse::<u64>().map_err(|_| bad());
    let (a, b, total) = (p(a)?, p(b)?, p(total)?);
    if a > b || b >= total {
        return Err(bad());
    }
    Ok((a, b, total))
}

/// Reads exactly `dst.len()` bytes of body; a body that ends early or runs long is retried.
fn read_body(resp: &mut Response, dst: &mut [u8]) -> Result<(), Failure> {
    if resp.content_length().is_some_and(|n| n != dst.len() as u64) {
        return Err(Failure::Fatal(format!(
            "the server announced {} bytes for a range of {}",
            resp.content_length().unwrap_or(0),
            dst.len()
        )));
    }
    let mut got = 0;
    while got < dst.len() {
        match resp.read(&mut dst[got..]) {
            Ok(0) => return Err(Failure::Transient(format!("the body ended after {got} of {} bytes", dst.len()))),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Failure::Transient(format!("reading the body after {got} bytes: {e}"))),
        }
    }
    let mut extra = [0u8; 1];
    match resp.read(&mut extra) {
        Ok(0) => Ok(()),
        Ok(_) => Err(Failure::Fatal("the body is longer than the range asked for".into())),
        Err(e) => Err(Failure::Transient(format!("finishing the body: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range_is_read_and_checked() {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_RANGE, "bytes 10-19/100".parse().unwrap());
        assert!(matches!(content_range(&h), Ok((10, 19, 100))));
        for bad in ["bytes 19-10/100", "bytes 10-100/100", "items 1-2/3", "bytes 1-2", "bytes a-2/3"] {
            h.insert(CONTENT_RANGE, bad.parse().unwrap());
            assert!(content_range(&h).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_bearer_token_goes_only_to_its_hosts() {
        let o = HttpOptions { bearer: Some(("t".into(), vec!["huggingface.co".into()])), ..Default::default() };
        assert_eq!(o.bearer_for("https://huggingface.co/a/b/resolve/main/x.gguf"), Some("t"));
        assert_eq!(o.bearer_for("https://cdn-lfs.huggingface.co/x"), Some("t"));
        for other in ["https://evilhuggingface.co/x", "https://huggingface.co.example.com/x", "http://127.0.0.1/x"] {
            assert_eq!(o.bearer_for(other), None, "{other}");
        }
        assert_eq!(HttpOptions::default().bearer_for("https://huggingface.co/x"), None);
    }

    #[test]
    fn statuses_are_sorted_into_retry_and_fail() {
        assert!(check_status(StatusCode::PARTIAL_CONTENT).is_ok());
        for s in [StatusCode::SERVICE_UNAVAILABLE, StatusCode::BAD_GATEWAY, StatusCode::TOO_MANY_REQUESTS] {
            assert!(matches!(check_status(s), Err(Failure::Transient(_))), "{s}");
        }
        for s in [StatusCode::NOT_FOUND, StatusCode::FORBIDDEN, StatusCode::PRECONDITION_FAILED] {
            assert!(matches!(check_status(s), Err(Failure::Fatal(_))), "{s}");
        }
    }
}
