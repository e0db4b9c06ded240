//! S3-compatible object stores: `s3://bucket/key` becomes a path-style URL on an endpoint,
//! and each request is signed with AWS Signature Version 4 from the usual credentials
//! (`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, else the profile
//! `AWS_PROFILE` (or `default`) of `~/.aws/credentials`; region from `AWS_REGION`,
//! `AWS_DEFAULT_REGION`, or `us-east-1`). Without credentials requests go unsigned (public
//! buckets).

use hmac::{Hmac, Mac};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};
use std::time::{SystemTime, UNIX_EPOCH};

/// SHA-256 of an empty body: every request sluice signs is a GET without one.
const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

#[derive(Clone, Debug)]
pub struct S3Auth {
    pub access_key: String,
    pub secret_key: String,
    pub session_token: Option<String>,
    pub region: String,
    /// Signing time as `YYYYMMDDTHHMMSSZ`; `None`: the clock (tests pin it).
    pub fixed_time: Option<String>,
}

/// Where an `s3://` URL's object is, and how to sign for it.
pub struct S3Target {
    pub url: String,
    pub auth: Option<S3Auth>,
}

/// Resolves `s3://bucket/key` against `endpoint` (or `AWS_ENDPOINT_URL`, else AWS's regional
/// endpoint) with credentials from the environment or `~/.aws/credentials`.
pub fn resolve(s3_url: &str, endpoint: Option<&str>) -> Result<S3Target, String> {
    let rest = s3_url.strip_prefix("s3://").ok_or_else(|| format!("{s3_url}: not an s3:// URL"))?;
    let (bucket, key) = rest
        .split_once('/')
        .filter(|(b, k)| !b.is_empty() && !k.is_empty())
        .ok_or_else(|| format!("{s3_url}: expected s3://BUCKET/KEY"))?;
    let region = env("AWS_REGION").or_else(|| env("AWS_DEFAULT_REGION")).unwrap_or_else(|| "us-east-1".into());
    let endpoint = endpoint
        .map(str::to_string)
        .or_else(|| env("AWS_ENDPOINT_URL"))
        .unwrap_or_else(|| format!("https://s3.{region}.amazonaws.com"));
    let endpoint = endpoint.trim_end_matches('/');
    let path: Vec<String> = key.split('/').map(encode).collect();
    let url = format!("{endpoint}/{}/{}", encode(bucket), path.join("/"));
    Ok(S3Target { url, auth: credentials(region)? })
}

fn env(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.is_empty())
}

fn credentials(region: String) -> Result<Option<S3Auth>, String> {
    if let (Some(a), Some(s)) = (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
        return Ok(Some(S3Auth {
            access_key: a,
            secret_key: s,
            session_token: env("AWS_SESSION_TOKEN"),
            region,
            fixed_time: None,
        }));
    }
    let file = env("AWS_SHARED_CREDENTIALS_FILE")
        .map(std::path::PathBuf::from)
        .or_else(|| env("HOME").map(|h| std::path::Path::new(&h).join(".aws/credentials")));
    let Some(file) = file.filter(|f| f.exists()) else { return Ok(None) };
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
    let profile = env("AWS_PROFILE").unwrap_or_else(|| "default".into());
    let mut section = String::new();
    let (mut a, mut s, mut t) = (None, None, None);
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.trim().to_string();
        } else if section == profile {
            if let Some((k, v)) = line.split_once('=') {
                let v = Some(v.trim().to_string());
                match k.trim() {
                    "aws_access_key_id" => a = v,
                    "aws_secret_access_key" => s = v,
                    "aws_session_token" => t = v,
                    _ => {}
                }
            }
        }
    }
    match (a, s) {
        (Some(a), Some(s)) => {
            Ok(Some(S3Auth { access_key: a, secret_key: s, session_token: t, region, fixed_time: None }))
        }
        _ => Err(format!("{}: profile `{profile}` has no aws_access_key_id and aws_secret_access_key", file.display())),
    }
}

/// URI-encodes one path segment the way SigV4 wants (unreserved characters kept).
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn hmac(key: &[u8], msg: &str) -> Vec<u8> {
    let mut m = Hmac::<Sha256>::new_from_slice(key).expect("any key length");
    m.update(msg.as_bytes());
    m.finalize().into_bytes().to_vec()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `YYYYMMDDTHHMMSSZ` for a Unix time (UTC, proleptic Gregorian).
fn amz_time(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let t = secs % 86400;
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z", t / 3600, t / 60 % 60, t % 60)
}

impl S3Auth {
    /// The headers that sign a bodiless `method` request for `url` carrying `headers`
    /// (which are signed too): `x-amz-date`, `x-amz-content-sha256`, the session token if
    /// any, and `Authorization`.
    pub fn sign(&self, method: &str, url: &str, headers: &HeaderMap) -> HeaderMap {
        let now = self.fixed_time.clone().unwrap_or_else(|| {
            amz_time(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0))
        });
        let date = &now[..8];
        let parsed = reqwest::Url::parse(url).ok();
        let host = parsed
            .as_ref()
            .map(|u| match u.port() {
                Some(p) => format!("{}:{p}", u.host_str().unwrap_or("")),
                None => u.host_str().unwrap_or("").to_string(),
            })
            .unwrap_or_default();
        let path = parsed.as_ref().map(|u| u.path().to_string()).unwrap_or_else(|| "/".into());
        let mut signed: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.as_str().to_ascii_lowercase(), v.to_str().unwrap_or("").trim().to_string()))
            .collect();
        signed.push(("host".into(), host));
        signed.push(("x-amz-content-sha256".into(), EMPTY_SHA256.into()));
        signed.push(("x-amz-date".into(), now.clone()));
        if let Some(t) = &self.session_token {
            signed.push(("x-amz-security-token".into(), t.clone()));
        }
        signed.sort();
        let names: Vec<&str> = signed.iter().map(|(k, _)| k.as_str()).collect();
        let names = names.join(";");
        let canonical_headers: String = signed.iter().map(|(k, v)| format!("{k}:{v}\n")).collect();
        let canonical = format!("{method}\n{path}\n\n{canonical_headers}\n{names}\n{EMPTY_SHA256}");
        let scope = format!("{date}/{}/s3/aws4_request", self.region);
        let to_sign = format!("AWS4-HMAC-SHA256\n{now}\n{scope}\n{}", hex(&Sha256::digest(canonical.as_bytes())));
        let k = hmac(format!("AWS4{}", self.secret_key).as_bytes(), date);
        let k = hmac(&k, &self.region);
        let k = hmac(&k, "s3");
        let k = hmac(&k, "aws4_request");
        let signature = hex(&hmac(&k, &to_sign));
        let mut out = HeaderMap::new();
        let mut put = |k: &'static str, v: String| {
            if let Ok(v) = HeaderValue::from_str(&v) {
                out.insert(HeaderName::from_static(k), v);
            }
        };
        put("x-amz-date", now.clone());
        put("x-amz-content-sha256", EMPTY_SHA256.into());
        if let Some(t) = &self.session_token {
            put("x-amz-security-token", t.clone());
        }
        put(
            "authorization",
            format!(
                "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={names}, Signature={signature}",
                self.access_key
            ),
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_matches_the_published_get_object_example() {
        // AWS's Signature Version 4 documentation signs `GET /test.txt` with `Range:
        // bytes=0-9` for bucket `examplebucket` at 2013-05-24T00:00:00Z with its example
        // keys, and publishes the signature.
        let auth = S3Auth {
            access_key: "AKIAIOSFODNN7EXAMPLE".into(),
            secret_key: "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into(),
            session_token: None,
            region: "us-east-1".into(),
            fixed_time: Some("20130524T000000Z".into()),
        };
        let mut h = HeaderMap::new();
        h.insert("range", "bytes=0-9".parse().unwrap());
        let s = auth.sign("GET", "https://examplebucket.s3.amazonaws.com/test.txt", &h);
        let a = s["authorization"].to_str().unwrap();
        assert!(a.ends_with("Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"), "{a}");
        assert!(a.contains("SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"), "{a}");
    }

    #[test]
    fn time_and_urls_are_formatted() {
        assert_eq!(amz_time(0), "19700101T000000Z");
        assert_eq!(amz_time(1369353600), "20130524T000000Z");
        assert_eq!(amz_time(951782400 + 86399), "20000229T235959Z");
        let t = resolve("s3://bucket/dir/a b+c.gguf", Some("http://127.0.0.1:9000/")).unwrap();
        assert_eq!(t.url, "http://127.0.0.1:9000/bucket/dir/a%20b%2Bc.gguf");
        assert!(resolve("s3://bucket", None).is_err());
        assert!(resolve("s3:///key", None).is_err());
    }
}
