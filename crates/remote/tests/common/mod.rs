//! A real HTTP server for the remote-tier tests (nginx, from the distribution's packages:
//! tools/test.sh installs it), and a proxy in front of it that injects faults.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub fn tests_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests")
}

/// A fresh, empty scratch directory.
pub fn scratch(name: &str) -> PathBuf {
    let d = sluice_formats::scratch_root().join(format!("sluice-remote-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Waits until something accepts connections on `port`; fails with `why()` after `limit`.
fn wait_for_port(port: u16, limit: Duration, why: impl Fn() -> String) {
    let t = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t.elapsed() < limit, "{}", why());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// nginx serving `root` on a loopback port, stopped on drop.
pub struct Nginx {
    pub port: u16,
    child: Child,
    _dir: PathBuf,
}

impl Nginx {
    pub fn start(root: &Path) -> Nginx {
        Nginx::start_with(root, None, "")
    }

    /// nginx serving `root` with `extra` lines in its server block.
    pub fn start_conf(root: &Path, extra: &str) -> Nginx {
        Nginx::start_with(root, None, extra)
    }

    /// nginx over TLS with HTTP/2, with the certificate and key at `tls`.
    pub fn start_tls(root: &Path, cert: &Path, key: &Path) -> Nginx {
        Nginx::start_with(root, Some((cert, key)), "")
    }

    fn start_with(root: &Path, tls: Option<(&Path, &Path)>, extra: &str) -> Nginx {
        let nginx = ["/usr/sbin/nginx", "/usr/bin/nginx", "/usr/local/sbin/nginx"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("nginx is not installed (tools/test.sh installs it: apt-get install nginx-light)");
        let dir = scratch(&format!("nginx-{}", free_port()));
        let port = free_port();
        let conf = format!(
            "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
             events {{ worker_connections 512; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d};\n  proxy_temp_path {d};\n  fastcgi_temp_path {d};\n  uwsgi_temp_path {d};\n  scgi_temp_path {d};\n\
             server {{\n    listen 127.0.0.1:{port}{ssl};\n{certs}    root {root};\n    location / {{ }}\n    {extra}\n  }}\n}}\n",
            d = dir.display(),
            root = root.display(),
            ssl = if tls.is_some() { " ssl http2" } else { "" },
            certs = match tls {
                Some((c, k)) => format!("    ssl_certificate {};\n    ssl_certificate_key {};\n", c.display(), k.display()),
                None => String::new(),
            }
        );
        std::fs::write(dir.join("nginx.conf"), conf).unwrap();
        let child = Command::new(nginx)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .arg("-p")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nginx");
        wait_for_port(port, Duration::from_secs(10), || {
            format!("nginx did not start: {:?}", std::fs::read_to_string(dir.join("error.log")))
        });
        Nginx { port, child, _dir: dir }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}/{path}", self.port)
    }

    pub fn https_url(&self, path: &str) -> String {
        format!("https://127.0.0.1:{}/{path}", self.port)
    }
}

/// A test certificate authority and a certificate it signed for 127.0.0.1 (with the
/// `openssl` command): (CA certificate, server certificate, server key).
pub fn test_certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl").args(args).current_dir(dir).output().expect("running openssl");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=sluice test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    run(&["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1"]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    (dir.join("ca.pem"), dir.join("srv.pem"), dir.join("srv.key"))
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the proxy does to one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    /// Answer 503 without asking the server.
    Unavailable,
    /// Close the connection without answering.
    Drop,
    /// Send the headers and half the body, then close.
    Truncate,
    /// Wait this long, then pass the answer on.
    Delay(Duration),
    /// Pass the answer on with a different ETag.
    WrongEtag,
}

/// A proxy to `upstream` that applies queued faults to the requests it sees, one per request,
/// in order (requests after the queue is empty pass unharmed).
pub struct FaultProxy {
    pub port: u16,
    pub faults: Arc<Mutex<VecDeque<Fault>>>,
    pub requests: Arc<AtomicU64>,
    /// Every request gets `Delay` of this many milliseconds (0: none).
    pub slow_ms: Arc<AtomicU64>,
    /// The head of every request seen.
    pub heads: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
}

impl FaultProxy {
    pub fn start(upstream: u16) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let faults: Arc<Mutex<VecDeque<Fault>>> = Arc::default();
        let requests = Arc::new(AtomicU64::new(0));
        let slow_ms = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let heads: Arc<Mutex<Vec<String>>> = Arc::default();
        let (f, r, s, st, hd) = (faults.clone(), requests.clone(), slow_ms.clone(), stop.clone(), heads.clone());
        std::thread::spawn(move || {
            for c in listener.incoming() {
                if st.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(c) = c else { continue };
                let (f, r, s, hd) = (f.clone(), r.clone(), s.clone(), hd.clone());
                std::thread::spawn(move || {
                    let _ = serve(c, upstream, &f, &r, &s, &hd);
                });
            }
        });
        FaultProxy { port, faults, requests, slow_ms, heads, stop }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}/{path}", self.port)
    }

    pub fn push(&self, f: Fault, n: usize) {
        let mut q = self.faults.lock().unwrap();
        for _ in 0..n {
            q.push_back(f);
        }
    }

    pub fn pending(&self) -> usize {
        self.faults.lock().unwrap().len()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn read_head(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.push(b[0]);
    }
    Ok(head)
}

/// Serves requests of one client connection (GETs without bodies), each over a new
/// upstream connection.
fn serve(
    mut c: TcpStream,
    upstream: u16,
    faults: &Mutex<VecDeque<Fault>>,
    requests: &AtomicU64,
    slow_ms: &AtomicU64,
    heads: &Mutex<Vec<String>>,
) -> std::io::Result<()> {
    loop {
        let head = read_head(&mut c)?;
        heads.lock().unwrap().push(String::from_utf8_lossy(&head).into_owned());
        requests.fetch_add(1, Ordering::Relaxed);
        let fault = faults.lock().unwrap().pop_front();
        let slow = slow_ms.load(Ordering::Relaxed);
        if slow > 0 {
            std::thread::sleep(Duration::from_millis(slow));
        }
        match fault {
            Some(Fault::Unavailable) => {
                c.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")?;
                continue;
            }
            Some(Fault::Drop) => return Ok(()),
            Some(Fault::Delay(d)) => std::thread::sleep(d),
            _ => {}
        }
        // Ask upstream with `Connection: close` so its answer ends at EOF.
        let text = String::from_utf8_lossy(&head);
        let mut req = String::new();
        for line in text.split("\r\n").filter(|l| !l.is_empty()) {
            if !line.to_ascii_lowercase().starts_with("connection:") {
                req.push_str(line);
                req.push_str("\r\n");
            }
        }
        req.push_str("Connection: close\r\n\r\n");
        let mut u = TcpStream::connect(("127.0.0.1", upstream))?;
        u.write_all(req.as_bytes())?;
        let mut resp = Vec::new();
        u.read_to_end(&mut resp)?;
        let split = resp.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4).unwrap_or(resp.len());
        let (h, body) = resp.split_at(split);
        let mut h = String::from_utf8_lossy(h).replace("Connection: close", "Connection: keep-alive");
        match fault {
            Some(Fault::Truncate) => {
                c.write_all(h.as_bytes())?;
                c.write_all(&body[..body.len() / 2])?;
                return Ok(());
            }
            Some(Fault::WrongEtag) => {
                let lines: Vec<String> = h
                    .split("\r\n")
                    .map(|l| {
                        if l.to_ascii_lowercase().starts_with("etag:") {
                            "ETag: \"not-the-same\"".to_string()
                        } else {
                            l.to_string()
                        }
                    })
                    .collect();
                h = lines.join("\r\n");
            }
            _ => {}
        }
        c.write_all(h.as_bytes())?;
        c.write_all(body)?;
    }
}

/// moto's server (an S3-compatible server from PyPI; tools/test.sh installs it under
/// ~/.cache/sluice/moto) with authentication on: it recomputes every request's Signature
/// Version 4 with botocore and refuses a wrong one. Set up with a bucket, the objects asked
/// for, and a user allowed to read them; stopped on drop.
pub struct S3Server {
    pub port: u16,
    /// The user's access key and secret.
    pub key: (String, String),
    child: Child,
}

const MOTO_SETUP: &str = r#"
import boto3, json, sys
port, bucket = sys.argv[1], sys.argv[2]
kw = dict(endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1", aws_access_key_id="setup", aws_secret_access_key="setup")
s3, iam = boto3.client("s3", **kw), boto3.client("iam", **kw)
s3.create_bucket(Bucket=bucket)
for pair in sys.argv[3:]:
    key, path = pair.split("=", 1)
    s3.put_object(Bucket=bucket, Key=key, Body=open(path, "rb").read())
iam.create_user(UserName="sluice")
iam.put_user_policy(UserName="sluice", PolicyName="read", PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"}]}))
k = iam.create_access_key(UserName="sluice")["AccessKey"]
print(k["AccessKeyId"], k["SecretAccessKey"])
"#;

impl S3Server {
    pub fn start(bucket: &str, objects: &[(&str, &Path)]) -> S3Server {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap();
        let lib = std::env::var_os("SLUICE_MOTO").map(PathBuf::from).unwrap_or_else(|| home.join(".cache/sluice/moto"));
        assert!(lib.join("moto").exists(), "{} is missing: tools/test.sh installs moto[server] there", lib.display());
        let port = free_port();
        // The setup's actions (bucket, objects, user, policy, key) are the unauthenticated ones.
        let setup_actions = 4 + objects.len();
        let child = Command::new("python3")
            .args(["-m", "moto.server", "-p", &port.to_string()])
            .env("PYTHONPATH", &lib)
            .env("INITIAL_NO_AUTH_ACTION_COUNT", setup_actions.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting moto's server");
        wait_for_port(port, Duration::from_secs(30), || "moto's server did not start".into());
        let mut args = vec!["-c".to_string(), MOTO_SETUP.to_string(), port.to_string(), bucket.to_string()];
        args.extend(objects.iter().map(|(k, p)| format!("{k}={}", p.display())));
        let out = Command::new("python3").args(&args).env("PYTHONPATH", &lib).output().unwrap();
        assert!(out.status.success(), "setting up moto: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        let (a, s) = text.trim().split_once(' ').expect("a key and a secret");
        S3Server { port, key: (a.to_string(), s.to_string()), child }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
