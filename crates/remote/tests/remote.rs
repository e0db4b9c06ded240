//! Models served by a real HTTP server (nginx) give the local files' logits bit for bit,
//! whatever the disk tier's size, through faults, and never mix a changed file.

mod common;

use common::{scratch, tests_dir, Fault, FaultProxy, Nginx, S3Server};
use sluice_experts::IoKind;
use sluice_model::Logits;
use sluice_remote::http::{HttpOptions, Retry};
use sluice_remote::{Mirror, RemoteOptions};
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};
use std::path::Path;
use std::time::Duration;

fn tokens(fam: &str) -> Vec<u32> {
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(tests_dir().join("golden").join(fam).join("golden.json")).unwrap(),
    )
    .unwrap();
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

fn options(experts: ExpertOptions) -> EngineOptions {
    EngineOptions { threads: 2, max_context: 256, experts, ..Default::default() }
}

fn bits(e: &Engine, toks: &[u32]) -> Result<Vec<u32>, String> {
    let mut kv = e.new_state();
    let l = e.model.forward(&mut kv, toks, Logits::All, None).map_err(|x| x.to_string())?;
    Ok(l.iter().map(|x| x.to_bits()).collect())
}

fn local_bits(path: &Path, toks: &[u32]) -> Vec<u32> {
    let e = Engine::load(path, options(ExpertOptions { mode: ExpertMode::Resident, ..Default::default() })).unwrap();
    bits(&e, toks).unwrap()
}

fn remote_options(dir: &Path, disk_quota: u64) -> RemoteOptions {
    RemoteOptions {
        dir: dir.to_path_buf(),
        disk_quota,
        http: HttpOptions {
            retry: Retry { attempts: 6, first_wait: Duration::from_millis(5), max_wait: Duration::from_millis(50) },
            timeout: Duration::from_millis(1500),
            ..HttpOptions::default()
        },
        ..RemoteOptions::new()
    }
}

/// Loads the model at `url` with an expert cache of `cache` bytes reading through the
/// remote tier.
fn load_remote(url: &str, o: &RemoteOptions, cache: u64) -> (Mirror, Engine) {
    let m = sluice_remote::open(url, o).unwrap_or_else(|e| panic!("{url}: {e}"));
    let experts = ExpertOptions {
        mode: ExpertMode::Stream,
        cache_bytes: Some(cache),
        io: IoKind::Ranges(m.reader.clone()),
        pressure: false,
        depth: 8,
        ..Default::default()
    };
    let e = Engine::load(&m.local, options(experts)).unwrap_or_else(|e| panic!("{url}: {e}"));
    (m, e)
}

#[test]
fn remote_models_give_the_local_files_logits_bit_for_bit_at_every_disk_tier_size() {
    let server = Nginx::start(&tests_dir());
    // Three GGUF families (MoE, MLA + dense first layers, a Gated-DeltaNet hybrid), two
    // Hugging Face directories (one whose experts are rewritten as they land), and a split GGUF.
    let models = [
        ("olmoe", "golden/gguf/olmoe-bf16.gguf"),
        ("deepseek_v3", "golden/gguf/deepseek_v3-bf16.gguf"),
        ("qwen3_next", "golden/gguf/qwen3_next-bf16.gguf"),
        ("qwen3_moe", "golden/qwen3_moe"),
        ("gpt_oss_mxfp4", "golden/gpt_oss_mxfp4"),
        // A GGUF split in six parts by llama.cpp's gguf-split.
        ("deepseek_v3", "golden/gguf/split/deepseek_v3-bf16-00001-of-00006.gguf"),
    ];
    for (fam, rel) in models {
        let toks = tokens(fam);
        let want = local_bits(&tests_dir().join(rel), &toks);
        let dir = scratch(&format!("tiers-{fam}-{}", rel.len()));
        // Disk tier: none, a few records (evicting), everything.
        for quota in [0u64, 64 << 10, 1 << 30] {
            for cache in [256u64 << 10, u64::MAX] {
                let (m, e) = load_remote(&server.url(rel), &remote_options(&dir, quota), cache);
                assert_eq!(bits(&e, &toks).unwrap(), want, "{fam}: disk tier {quota}, cache {cache}");
                let s = m.reader.stats();
                match (&s.disk, quota) {
                    (None, 0) => assert!(s.remote.reads > 0, "{fam}: experts came from the server"),
                    (Some(d), q) if q < 1 << 30 => {
                        assert!(m.reader.disk().unwrap().used() <= q, "{fam}: the disk tier keeps its quota");
                        assert!(d.writes > 0, "{fam}")
                    }
                    (Some(_), _) => {}
                    (None, _) => panic!("{fam}: a quota without a disk tier"),
                }
                assert_eq!(s.remote.errors, 0);
            }
        }
        // Warm: the dense weights and every expert are local now; nothing goes to the server.
        let (m, e) = load_remote(&server.url(rel), &remote_options(&dir, 1 << 30), u64::MAX);
        assert_eq!(m.fetched_bytes, 0, "{fam}: the stand-ins were complete");
        assert_eq!(bits(&e, &toks).unwrap(), want, "{fam}: warm");
        let s = m.reader.stats();
        assert_eq!(s.remote.reads, 0, "{fam}: a warm disk tier serves every expert");
        assert!(s.disk.unwrap().hits > 0);
        let st = e.expert_stats();
        assert_eq!(st.tiers.iter().map(|t| t.tier.as_str()).collect::<Vec<_>>(), ["disk", "remote"]);
        assert_eq!(st.tiers[0].reads, s.disk.unwrap().hits, "{fam}: the engine reports the tiers");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn faults_are_retried_and_never_give_wrong_bytes() {
    let server = Nginx::start(&tests_dir());
    let proxy = FaultProxy::start(server.port);
    let rel = "golden/gguf/olmoe-bf16.gguf";
    let toks = tokens("olmoe");
    let want = local_bits(&tests_dir().join(rel), &toks);
    let dir = scratch("faults");
    let faults = [Fault::Unavailable, Fault::Drop, Fault::Truncate, Fault::Delay(Duration::from_millis(2500))];
    // While opening (header and dense weights), then while reading experts.
    for f in faults {
        proxy.push(f, 1);
    }
    // Enough tries that one request meeting every queued fault in a row still succeeds.
    let mut patient = remote_options(&dir, 0);
    patient.http.retry.attempts = 16;
    let (m, e) = load_remote(&proxy.url(rel), &patient, 256 << 10);
    assert_eq!(proxy.pending(), 0, "the faults met the opening requests");
    for f in faults.iter().cycle().take(12) {
        proxy.push(*f, 1);
    }
    let before = proxy.requests.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(bits(&e, &toks).unwrap(), want, "retried reads give the same bits");
    assert_eq!(proxy.pending(), 0, "every fault was met");
    assert!(proxy.requests.load(std::sync::atomic::Ordering::Relaxed) - before > 12);
    assert_eq!(m.reader.stats().remote.errors, 0, "every fault was retried away");

    // A server that keeps failing: the request fails with an error naming the range and
    // the cause, and the engine stays usable once the server recovers.
    let (m, e) = load_remote(&proxy.url(rel), &remote_options(&dir, 0), 256 << 10);
    proxy.push(Fault::Unavailable, 1000);
    let err = bits(&e, &toks).unwrap_err();
    assert!(err.contains("503") && err.contains("bytes") && err.contains("gave up"), "{err}");
    assert!(m.reader.stats().remote.errors > 0);
    proxy.faults.lock().unwrap().clear();
    // Reads still in flight (prefetches) finish failing first; their failures reach only
    // requests waiting on them.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(bits(&e, &toks).unwrap(), want, "after the server recovers");

    // An answer with another ETag than the file had is refused, not used.
    let (_m, e) = load_remote(&proxy.url(rel), &remote_options(&dir, 0), 256 << 10);
    proxy.push(Fault::WrongEtag, 1);
    let err = bits(&e, &toks).unwrap_err();
    assert!(err.contains("changed underneath"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_file_changed_underneath_is_detected_and_a_damaged_local_copy_is_fetched_again() {
    let served = scratch("changed-root");
    let file = served.join("m.gguf");
    std::fs::copy(tests_dir().join("golden/gguf/olmoe-bf16.gguf"), &file).unwrap();
    let server = Nginx::start(&served);
    let toks = tokens("olmoe");
    let dir = scratch("changed");
    let (_m, e) = load_remote(&server.url("m.gguf"), &remote_options(&dir, 1 << 30), 256 << 10);

    // Replace the file with another one (the Mixtral golden) under the same name.
    let other = tests_dir().join("golden/gguf/mixtral-bf16.gguf");
    std::fs::copy(&other, served.join("tmp")).unwrap();
    std::fs::rename(served.join("tmp"), &file).unwrap();
    let f = std::fs::File::options().write(true).open(&file).unwrap();
    f.set_modified(std::time::SystemTime::now() + Duration::from_secs(100)).unwrap();
    drop(f);
    let err = bits(&e, &toks).unwrap_err();
    assert!(err.contains("changed underneath"), "{err}");

    // Opened again, it is the new file, with the new file's logits.
    let toks = tokens("mixtral");
    let (m, e) = load_remote(&server.url("m.gguf"), &remote_options(&dir, 1 << 30), 256 << 10);
    assert!(m.fetched_bytes > 0);
    assert_eq!(bits(&e, &toks).unwrap(), local_bits(&other, &toks));
    drop(e);

    // Damage the local stand-in's dense bytes and an expert record: both are noticed and
    // fetched again.
    let stand_in = &m.local;
    let len = std::fs::metadata(stand_in).unwrap().len();
    use std::os::unix::fs::FileExt;
    let h = std::fs::File::options().write(true).open(stand_in).unwrap();
    let mut b = [0u8; 1];
    h.read_exact_at(&mut b, len - 1).ok();
    h.write_all_at(&[b[0] ^ 0xff], len - 1).unwrap();
    let records: Vec<_> =
        walk(&dir.join("experts")).into_iter().filter(|p| p.extension().is_some_and(|x| x == "rec")).collect();
    assert!(!records.is_empty());
    for r in &records {
        let f = std::fs::File::options().write(true).open(r).unwrap();
        f.write_all_at(b"garbage", sluice_remote::disk::HEADER as u64 + 40).unwrap();
    }
    let (m, e) = load_remote(&server.url("m.gguf"), &remote_options(&dir, 1 << 30), 256 << 10);
    assert!(m.fetched_bytes > 0, "the damaged stand-in was fetched again");
    assert_eq!(bits(&e, &toks).unwrap(), local_bits(&other, &toks));
    let s = m.reader.stats();
    assert!(s.disk.unwrap().bad_records > 0 && s.remote.reads > 0, "{s:?}");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&served).unwrap();
}

fn walk(d: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(d).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn an_s3_model_is_read_with_signed_range_requests_and_gives_the_local_logits() {
    let rel = "golden/gguf/olmoe-bf16.gguf";
    let s3 = S3Server::start("models", &[("moe/olmoe.gguf", &tests_dir().join(rel))]);
    // The proxy records what reaches the server.
    let proxy = FaultProxy::start(s3.port);
    std::env::set_var("AWS_REGION", "us-east-1");
    let dir = scratch("s3");
    let mut o = remote_options(&dir, 1 << 20);
    o.s3_endpoint = Some(format!("http://127.0.0.1:{}", proxy.port));
    // A wrong secret: the server recomputes the signature and refuses it, at once.
    std::env::set_var("AWS_ACCESS_KEY_ID", &s3.key.0);
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "not-the-secret");
    let err = sluice_remote::open("s3://models/moe/olmoe.gguf", &o).err().unwrap().to_string();
    assert!(err.contains("403"), "{err}");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", &s3.key.1);
    let toks = tokens("olmoe");
    let want = local_bits(&tests_dir().join(rel), &toks);
    let (m, e) = load_remote("s3://models/moe/olmoe.gguf", &o, 256 << 10);
    assert_eq!(bits(&e, &toks).unwrap(), want);
    assert!(m.reader.stats().remote.reads > 0);
    let heads = proxy.heads.lock().unwrap().clone();
    assert!(!heads.is_empty());
    for h in &heads {
        let h = h.to_ascii_lowercase();
        assert!(h.starts_with("get /models/moe/olmoe.gguf "), "path-style request: {h}");
        assert!(h.contains(&format!("credential={}/", s3.key.0.to_ascii_lowercase())), "signed: {h}");
        assert!(h.contains("signedheaders=host;") && h.contains("range: bytes="), "{h}");
    }
    // A key that is not there is an error naming it.
    let err = sluice_remote::open("s3://models/nothing.gguf", &o).err().unwrap().to_string();
    assert!(err.contains("nothing.gguf") && (err.contains("404") || err.contains("403")), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn touching_and_overlapping_reads_are_fetched_with_one_request_and_kept_as_records_of_their_own() {
    use sluice_experts::io::RangeReader;
    let server = Nginx::start(&tests_dir());
    let proxy = FaultProxy::start(server.port);
    let rel = "golden/gguf/olmoe-bf16.gguf";
    let dir = scratch("merge");
    let m = sluice_remote::open(&proxy.url(rel), &remote_options(&dir, 1 << 20)).unwrap();
    let bytes = std::fs::read(tests_dir().join(rel)).unwrap();
    // Three reads: the second overlaps the first by a block (as ranges widened to 4 KiB do),
    // the third starts where the second ends.
    let reads_of = || -> Vec<(u64, Vec<u8>)> {
        vec![(65536, vec![0u8; 8192]), (65536 + 4096, vec![0u8; 8192]), (65536 + 12288, vec![0u8; 4096])]
    };
    let check = |bufs: &[(u64, Vec<u8>)]| {
        for (off, b) in bufs {
            assert_eq!(&b[..], &bytes[*off as usize..*off as usize + b.len()], "bytes at {off}");
        }
    };
    let requests = || proxy.requests.load(std::sync::atomic::Ordering::Relaxed);
    let run = |m: &sluice_remote::Mirror, bufs: &mut Vec<(u64, Vec<u8>)>| {
        let mut reads: Vec<(u64, &mut [u8])> = bufs.iter_mut().map(|(o, b)| (*o, b.as_mut_slice())).collect();
        let results = m.reader.read_run(0, &mut reads);
        assert!(results.iter().zip(&reads).all(|(r, (_, d))| *r.as_ref().unwrap() == d.len()), "{results:?}");
    };
    let mut bufs = reads_of();
    let before = requests();
    run(&m, &mut bufs);
    assert_eq!(requests() - before, 1, "one request for three reads");
    check(&bufs);
    assert_eq!(m.reader.stats().remote.coalesced, 2);
    // Each read is its own record: the middle one alone is a disk-tier hit, no request.
    let mut mid = vec![0u8; 8192];
    assert_eq!(m.reader.read_at(0, 65536 + 4096, &mut mid).unwrap(), 8192);
    assert_eq!(mid, &bytes[65536 + 4096..65536 + 12288]);
    assert_eq!(requests() - before, 1);
    // With the first and last local, only the middle one is fetched.
    std::fs::remove_dir_all(dir.join("experts")).unwrap();
    let m = sluice_remote::open(&proxy.url(rel), &remote_options(&dir, 1 << 20)).unwrap();
    let mut a = vec![0u8; 8192];
    m.reader.read_at(0, 65536, &mut a).unwrap();
    let mut c = vec![0u8; 4096];
    m.reader.read_at(0, 65536 + 12288, &mut c).unwrap();
    let before = requests();
    let mut bufs = reads_of();
    run(&m, &mut bufs);
    check(&bufs);
    assert_eq!(requests() - before, 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes `src` (a Hugging Face directory with one `model.safetensors`) to `dst` as two shards
/// with a `model.safetensors.index.json`, as `save_pretrained` shards larger models.
fn shard_hf(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        let n = e.file_name().into_string().unwrap();
        if n != "model.safetensors" {
            std::fs::copy(e.path(), dst.join(&n)).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let hlen = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + hlen]).unwrap();
    let data = &bytes[8 + hlen..];
    let names: Vec<&String> = header.keys().filter(|k| *k != "__metadata__").collect();
    let mut weight_map = serde_json::Map::new();
    for (part, chunk) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", part + 1);
        let (mut h, mut body) = (serde_json::Map::new(), Vec::new());
        for n in chunk {
            let mut info = header[*n].clone();
            let off = info["data_offsets"].as_array().unwrap();
            let (a, b) = (off[0].as_u64().unwrap() as usize, off[1].as_u64().unwrap() as usize);
            info["data_offsets"] = serde_json::json!([body.len(), body.len() + b - a]);
            body.extend_from_slice(&data[a..b]);
            h.insert((*n).clone(), info);
            weight_map.insert((*n).clone(), file.clone().into());
        }
        let h = serde_json::to_vec(&h).unwrap();
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.extend_from_slice(&body);
        std::fs::write(dst.join(&file), out).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dst.join("model.safetensors.index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
}

#[test]
fn a_sharded_hugging_face_directory_is_read_through_its_index() {
    let root = scratch("sharded-root");
    shard_hf(&tests_dir().join("golden/qwen3_moe"), &root.join("qwen3_moe"));
    let toks = tokens("qwen3_moe");
    let want = local_bits(&tests_dir().join("golden/qwen3_moe"), &toks);
    assert_eq!(local_bits(&root.join("qwen3_moe"), &toks), want, "the sharded copy is the same model");
    let server = Nginx::start(&root);
    let dir = scratch("sharded");
    for quota in [0u64, 1 << 30] {
        let (m, e) = load_remote(&server.url("qwen3_moe"), &remote_options(&dir, quota), 256 << 10);
        assert_eq!(m.reader.files().len(), 2, "both shards");
        assert_eq!(bits(&e, &toks).unwrap(), want, "disk tier {quota}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_redirect_is_followed_for_every_range_and_the_token_stays_with_its_host() {
    // As Hugging Face's `resolve` URLs do: the file's URL answers with a redirect to another
    // origin (here: another port) that serves the bytes.
    let server = Nginx::start(&tests_dir());
    let target = FaultProxy::start(server.port);
    let redirector = Nginx::start_conf(
        &tests_dir(),
        // It wants the token (403 without it).
        &format!(
            "location /moved/ {{ if ($http_authorization != \"Bearer secret-token\") {{ return 403; }} rewrite ^/moved/(.*)$ http://127.0.0.1:{}/$1 redirect; }}",
            target.port
        ),
    );
    let rel = "golden/gguf/olmoe-bf16.gguf";
    let toks = tokens("olmoe");
    let want = local_bits(&tests_dir().join(rel), &toks);
    let dir = scratch("redirect");
    let mut o = remote_options(&dir, 0);
    let err = sluice_remote::open(&redirector.url(&format!("moved/{rel}")), &o).err().unwrap().to_string();
    assert!(err.contains("403"), "without the token: {err}");
    o.http.bearer = Some(("secret-token".into(), vec!["127.0.0.1".into()]));
    let (m, e) = load_remote(&redirector.url(&format!("moved/{rel}")), &o, 256 << 10);
    assert_eq!(bits(&e, &toks).unwrap(), want);
    let heads = target.heads.lock().unwrap().clone();
    assert!(heads.len() as u64 >= m.reader.stats().remote.reads, "every read went through the redirect");
    for h in &heads {
        let h = h.to_ascii_lowercase();
        assert!(h.contains("range: bytes="), "{h}");
        assert!(!h.contains("secret-token"), "the token followed a redirect to another origin: {h}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
