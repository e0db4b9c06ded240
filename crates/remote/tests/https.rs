//! A model over HTTPS with HTTP/2 (nginx with a certificate from a test authority): refused
//! while the authority is unknown, then read over HTTP/2 once `SSL_CERT_FILE` names it, with
//! the local file's logits. (A test binary of its own: it sets `SSL_CERT_FILE` for the
//! process.)

mod common;

use common::{scratch, test_certificates, tests_dir, Nginx};
use sluice_experts::IoKind;
use sluice_model::Logits;
use sluice_remote::RemoteOptions;
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};

fn logits(path: &std::path::Path, io: IoKind) -> Vec<u32> {
    let experts = ExpertOptions {
        mode: ExpertMode::Stream,
        cache_bytes: Some(256 << 10),
        io,
        pressure: false,
        ..Default::default()
    };
    let e = Engine::load(path, EngineOptions { threads: 2, max_context: 64, experts, ..Default::default() }).unwrap();
    let mut kv = e.new_state();
    e.model.forward(&mut kv, &[1, 2, 3, 4, 5, 6], Logits::All, None).unwrap().iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_model_over_https_is_read_over_http2_once_its_authority_is_trusted() {
    let certs = scratch("certs");
    let (ca, cert, key) = test_certificates(&certs);
    let server = Nginx::start_tls(&tests_dir(), &cert, &key);
    let rel = "golden/gguf/olmoe-bf16.gguf";
    let url = server.https_url(rel);
    let dir = scratch("https");
    let o = RemoteOptions { dir: dir.clone(), disk_quota: 1 << 20, ..RemoteOptions::new() };
    std::env::remove_var("SSL_CERT_FILE");
    let t = std::time::Instant::now();
    let err = sluice_remote::open(&url, &o).err().expect("an unknown authority is refused").to_string();
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    assert!(t.elapsed().as_secs() < 3, "an untrusted certificate is not retried");
    std::env::set_var("SSL_CERT_FILE", &ca);
    let m = sluice_remote::open(&url, &o).unwrap();
    assert_eq!(m.reader.protocol().as_deref(), Some("HTTP/2.0"));
    let want = logits(&tests_dir().join(rel), IoKind::Auto);
    assert_eq!(logits(&m.local, IoKind::Ranges(m.reader.clone())), want);
    assert!(m.reader.stats().remote.reads > 0);
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&certs).unwrap();
}
