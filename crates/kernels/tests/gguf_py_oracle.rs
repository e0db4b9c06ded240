//! Every weight format sluice loads, held against an implementation that is not sluice's own:
//! real blocks made by llama.cpp's `llama-quantize` and the values gguf-py (llama.cpp's Python
//! GGUF library) dequantizes them to, committed under tests/blocks by
//! tools/golden/make_block_fixtures.py (see tests/blocks/index.json for versions and commands).
//!
//! For every fixture of a type sluice knows:
//!
//! * dequantization equals gguf-py's values bit for bit (see `exact_dequantization` for why
//!   that is the right demand for each format);
//! * the quantized matmul of the fixture rows with fixed pseudo-random activations (1, 7 and
//!   20 tokens) is within a derived bound of the f64 dot product of gguf-py's values with the
//!   same f32 activations: the kernels quantize activations to 8 bits, so the bound is
//!   essentially Σ|w_i|·(that quantization's worst error at i) (`quant_bound`);
//! * corrupting the blocks the way a wrong decoder would read them (nibbles swapped, a
//!   neighbour's scale, a min with the wrong sign) breaks that bound, so it can catch a wrong
//!   formula and is not merely loose.
//!
//! A listed fixture that is missing or of the wrong size fails the test. Fixtures of types
//! sluice does not know yet are reported; once `DType::from_name` knows such a type it is
//! checked like the others, and the test fails until index.json says so.

use sluice_kernels::{compare, matmul, quant, DType, MatRef, ThreadPool};
use std::collections::BTreeMap;
use std::path::PathBuf;

// ---------------------------------------------------------------------------------------
// index.json (a small JSON reader: the kernels crate has no JSON dependency)

#[derive(Debug, Clone)]
enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(BTreeMap<String, Json>),
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Result<(), String> {
        self.ws();
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            Ok(())
        } else {
            Err(format!("expected '{}' at byte {}", c as char, self.i))
        }
    }

    fn value(&mut self) -> Result<Json, String> {
        self.ws();
        match self.s.get(self.i).copied() {
            Some(b'{') => {
                self.i += 1;
                let mut m = BTreeMap::new();
                self.ws();
                if self.s.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Ok(Json::Obj(m));
                }
                loop {
                    self.ws();
                    let k = self.string()?;
                    self.eat(b':')?;
                    m.insert(k, self.value()?);
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Json::Obj(m));
                        }
                        _ => return Err(format!("expected ',' or '}}' at byte {}", self.i)),
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut v = Vec::new();
                self.ws();
                if self.s.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Ok(Json::Arr(v));
                }
                loop {
                    v.push(self.value()?);
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Json::Arr(v));
                        }
                        _ => return Err(format!("expected ',' or ']' at byte {}", self.i)),
                    }
                }
            }
            Some(b'"') => Ok(Json::Str(self.string()?)),
            Some(b't') if self.s[self.i..].starts_with(b"true") => {
                self.i += 4;
                Ok(Json::Bool(true))
            }
            Some(b'f') if self.s[self.i..].starts_with(b"false") => {
                self.i += 5;
                Ok(Json::Bool(false))
            }
            Some(b'n') if self.s[self.i..].starts_with(b"null") => {
                self.i += 4;
                Ok(Json::Null)
            }
            Some(c) if c == b'-' || c.is_ascii_digit() => {
                let start = self.i;
                while self.i < self.s.len() && matches!(self.s[self.i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.s[start..self.i]).map_err(|e| e.to_string())?;
                t.parse().map(Json::Num).map_err(|_| format!("bad number {t:?}"))
            }
            _ => Err(format!("unexpected input at byte {}", self.i)),
        }
    }

    fn string(&mut self) -> Result<String, String> {
        self.eat(b'"')?;
        let mut out = String::new();
        loop {
            let c = *self.s.get(self.i).ok_or("unterminated string")?;
            self.i += 1;
            match c {
                b'"' => return Ok(out),
                b'\\' => {
                    let e = *self.s.get(self.i).ok_or("unterminated escape")?;
                    self.i += 1;
                    match e {
                        b'"' | b'\\' | b'/' => out.push(e as char),
                        b'n' => out.push('\n'),
                        b't' => out.push('\t'),
                        b'r' => out.push('\r'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'u' => {
                            let h = self.s.get(self.i..self.i + 4).ok_or("short \\u escape")?;
                            let h = std::str::from_utf8(h).map_err(|e| e.to_string())?;
                            let c = u32::from_str_radix(h, 16).map_err(|e| e.to_string())?;
                            self.i += 4;
                            // Surrogate pairs do not occur in index.json; stand-in if one did.
                            out.push(char::from_u32(c).unwrap_or('\u{fffd}'));
                        }
                        _ => return Err(format!("bad escape \\{}", e as char)),
                    }
                }
                _ => {
                    // Multi-byte UTF-8 sequences pass through byte by byte.
                    let start = self.i - 1;
                    let mut end = self.i;
                    while end < self.s.len() && (self.s[end] & 0xC0) == 0x80 {
                        end += 1;
                    }
                    out.push_str(std::str::from_utf8(&self.s[start..end]).map_err(|e| e.to_string())?);
                    self.i = end;
                }
            }
        }
    }
}

fn parse_json(text: &str) -> Result<Json, String> {
    let mut p = Parser { s: text.as_bytes(), i: 0 };
    let v = p.value()?;
    p.ws();
    if p.i != p.s.len() {
        return Err(format!("trailing input at byte {}", p.i));
    }
    Ok(v)
}

impl Json {
    fn get(&self, k: &str) -> &Json {
        match self {
            Json::Obj(m) => m.get(k).unwrap_or_else(|| panic!("index.json: no key {k:?}")),
            _ => panic!("index.json: {k:?} looked up in a non-object"),
        }
    }
    fn str(&self) -> &str {
        match self {
            Json::Str(s) => s,
            other => panic!("index.json: expected a string, got {other:?}"),
        }
    }
    fn usize(&self) -> usize {
        match self {
            Json::Num(n) if *n >= 0.0 && n.fract() == 0.0 => *n as usize,
            other => panic!("index.json: expected a count, got {other:?}"),
        }
    }
    fn bool(&self) -> bool {
        match self {
            Json::Bool(b) => *b,
            other => panic!("index.json: expected a boolean, got {other:?}"),
        }
    }
}

#[test]
fn json_reader_reads_what_python_writes() {
    let v = parse_json(r#" {"a": [1, -2.5e3, true, false, null], "b\"c": "x\u00e9y", "d": {}} "#).unwrap();
    assert_eq!(v.get("b\"c").str(), "xéy");
    match v.get("a") {
        Json::Arr(a) => {
            assert_eq!(a.len(), 5);
            assert!(matches!(a[1], Json::Num(n) if n == -2500.0));
            assert!(a[2].bool() && !a[3].bool() && matches!(a[4], Json::Null));
        }
        _ => panic!("not an array"),
    }
    assert!(parse_json("{\"a\": 1,}").is_err());
    assert!(parse_json("[1] 2").is_err());
}

// ---------------------------------------------------------------------------------------
// Fixtures

/// One fixture: raw rows of `type_name` and gguf-py's values of them.
struct Fixture {
    type_name: String,
    /// `DType::from_name(type_name)`: `None` while sluice does not know the type.
    dtype: Option<DType>,
    /// What index.json says (the test holds it equal to what sluice knows).
    sluice_loads: bool,
    rows: usize,
    cols: usize,
    raw: Vec<u8>,
    values: Vec<f32>,
}

impl Fixture {
    fn row_bytes(&self) -> usize {
        self.raw.len() / self.rows
    }
    fn raw_row(&self, r: usize) -> &[u8] {
        &self.raw[r * self.row_bytes()..(r + 1) * self.row_bytes()]
    }
    fn values_row(&self, r: usize) -> &[f32] {
        &self.values[r * self.cols..(r + 1) * self.cols]
    }
}

fn blocks_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/blocks")
}

/// Every fixture listed in index.json. A listed file that is missing or of the wrong size is
/// a failure, never a skip.
fn fixtures() -> Vec<Fixture> {
    let dir = blocks_dir();
    let index_path = dir.join("index.json");
    let text = std::fs::read_to_string(&index_path)
        .unwrap_or_else(|e| panic!("{}: {e} (made by tools/golden/make_block_fixtures.py)", index_path.display()));
    let index = parse_json(&text).unwrap_or_else(|e| panic!("{}: {e}", index_path.display()));
    let Json::Arr(list) = index.get("fixtures") else { panic!("index.json: fixtures is not a list") };
    assert!(!list.is_empty(), "index.json lists no fixtures");
    list.iter()
        .map(|e| {
            let type_name = e.get("type").str().to_string();
            let file = e.get("file").str();
            let (rows, cols, row_bytes) = (e.get("rows").usize(), e.get("cols").usize(), e.get("row_bytes").usize());
            assert!(rows > 0 && cols > 0 && row_bytes > 0, "{type_name}: empty fixture");
            let read = |ext: &str| {
                let p = dir.join(format!("{file}.{ext}"));
                std::fs::read(&p)
                    .unwrap_or_else(|err| panic!("{type_name}: listed fixture {} unreadable: {err}", p.display()))
            };
            let raw = read("bin");
            let f32s = read("f32");
            assert_eq!(raw.len(), rows * row_bytes, "{type_name}: {file}.bin is not {rows} rows of {row_bytes} bytes");
            assert_eq!(f32s.len(), rows * cols * 4, "{type_name}: {file}.f32 is not {rows} × {cols} float32");
            let values: Vec<f32> = f32s.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
            assert!(values.iter().all(|v| v.is_finite()), "{type_name}: gguf-py values are not all finite");
            let dtype = DType::from_name(&type_name);
            if let Some(d) = dtype {
                assert_eq!(
                    d.row_bytes(cols),
                    Some(row_bytes),
                    "{type_name}: sluice's row size for {cols} columns differs from the fixture's"
                );
            }
            Fixture { type_name, dtype, sluice_loads: e.get("sluice_loads").bool(), rows, cols, raw, values }
        })
        .collect()
}

/// The fixtures of types sluice knows (and so must check).
fn known() -> Vec<(DType, Fixture)> {
    fixtures().into_iter().filter_map(|f| f.dtype.map(|d| (d, f))).collect()
}

#[test]
fn every_format_sluice_loads_has_a_fixture_and_the_index_says_which() {
    let all = fixtures();
    // Every weight format the kernels consume. F32 is excluded: its stored bits are its
    // values (nothing to decode). Q8_K is an activation format, never a stored weight.
    for d in DType::ALL {
        if d == DType::F32 || !sluice_kernels::supports_matmul(d) {
            continue;
        }
        assert!(all.iter().any(|f| f.dtype == Some(d)), "no gguf-py fixture for {d} in tests/blocks/index.json");
    }
    let mut wrong = Vec::new();
    for f in &all {
        let knows = f.dtype.is_some_and(sluice_kernels::supports_matmul);
        if !knows {
            eprintln!(
                "{}: fixture present, sluice does not load this type yet ({})",
                f.type_name,
                if f.dtype.is_some() { "known to DType, but no kernel" } else { "unknown to DType::from_name" }
            );
        }
        if knows != f.sluice_loads {
            wrong.push(format!(
                "{}: index.json says sluice_loads = {}, but sluice {} it; update tests/blocks/index.json \
                 (SLUICE_LOADS in tools/golden/make_block_fixtures.py)",
                f.type_name,
                f.sluice_loads,
                if knows { "loads" } else { "does not load" }
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

// ---------------------------------------------------------------------------------------
// (a) Dequantization

/// Whether sluice's dequantization must equal gguf-py's to the bit. It must for every format
/// sluice loads today, because the arithmetic leaves no room for a difference: every product
/// in these formulas is exact in f32, so the only rounding is at most one final add, which
/// both sides apply to the same two operands (and ggml-quants.c's dequantize_row_* too).
///
/// * F16, BF16: widening to f32 is exact.
/// * Q4_0, Q5_0, Q8_0, MXFP4: `d·q`: an f16 (11 significant bits) or a power of two times a
///   code of at most 7 bits: exact.
/// * Q4_1, Q5_1: `d·q + m`: `d·q` is exact (at most 16 bits), so the sum rounds once, fused
///   or not.
/// * Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: `(d·sc)·q [− dmin·m]`: `d·sc` takes at most 11 + 7 bits and
///   times a code of at most 5 bits stays within f32's 24; `dmin·m` is exact; the subtraction
///   rounds once.
///
/// * IQ formats: every value is `D·s·c` — an f16 (11 bits) times a power of two, an integer
///   scale of at most 6 bits (`2s + 1` ≤ 31, `ls − 32` in −32..31) and a code of at most 7
///   bits (IQ4's levels ≤ 127, grid values ≤ 62, IQ1's `8·grid ± 1` ≤ 9; IQ1's `grid ± ⅛` is
///   that code over 8): at most 24 significant bits, so every product is exact in whichever
///   grouping (ggml's `(d·(½+s)·¼)·grid·sign`, gguf-py's, sluice's `(D·s)·c`), with no
///   subnormal step (the smallest f16 times ⅛ is 2^-27).
///
/// What remains is the sign of zero, which a bitwise comparison sees. Q4_0 and Q5_0 blocks have
/// negative `d` (llama.cpp maps the signed maximum to −8 or −16), so code 0 gives −0 on both
/// sides. For Q3_K and Q6_K the association matters: gguf-py and ggml-quants.c compute
/// `(d·sc)·q`, which is −0 when `d·sc < 0` and `q = 0`, where `d·(sc·q)` would give +0 (on
/// the Q6_K fixture 208 of 12288 values differ between the two; sluice follows the reference).
/// In the IQ formats only `d` can be zero (codes and scales never are), and a product of
/// factors has the sign of their signs whatever the grouping, so they agree there too.
///
/// A format not named here (one added later) is held to `NEAR` of the row's largest magnitude
/// instead, until its arithmetic is shown to leave no room either and it is added to the list.
fn exact_dequantization(d: DType) -> bool {
    use DType::*;
    matches!(
        d,
        F16 | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | MXFP4
            | IQ4_NL
            | IQ4_XS
            | IQ3_XXS
            | IQ3_S
            | IQ2_XXS
            | IQ2_XS
            | IQ2_S
            | IQ1_S
            | IQ1_M
    )
}

/// Tolerance of a format not known to be exact, relative to the row's largest |value|: a value
/// computed through three rounded products in another order differs by at most about three
/// f32 roundings (2^-24 each, relative); doubled.
const NEAR: f32 = 6.0 / (1u32 << 24) as f32;

#[test]
fn dequantization_equals_gguf_py() {
    let mut failures = Vec::new();
    for (d, f) in known() {
        let mut worst = 0f32;
        for r in 0..f.rows {
            let mut out = vec![0f32; f.cols];
            if let Err(e) = quant::dequantize_row(d, f.raw_row(r), &mut out) {
                failures.push(format!("{d} row {r}: {e}"));
                break;
            }
            let want = f.values_row(r);
            if exact_dequantization(d) {
                if let Some(i) = compare::first_difference(&out, want) {
                    failures.push(format!(
                        "{d} row {r} element {i} (block {}): sluice {:e} ({:#010x}) vs gguf-py {:e} ({:#010x})",
                        i / d.block_elems(),
                        out[i],
                        out[i].to_bits(),
                        want[i],
                        want[i].to_bits()
                    ));
                    break;
                }
            } else {
                let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                match compare::max_abs_diff(&out, want) {
                    Ok(e) if e <= NEAR * max => worst = worst.max(e / max.max(f32::MIN_POSITIVE)),
                    Ok(e) => failures.push(format!("{d} row {r}: max |diff| {e:e} > {NEAR:e} × {max:e}")),
                    Err(e) => failures.push(format!("{d} row {r}: {e}")),
                }
            }
        }
        if exact_dequantization(d) {
            eprintln!("{d}: dequantization equals gguf-py bit for bit ({} × {})", f.rows, f.cols);
        } else {
            eprintln!("{d}: dequantization within {worst:e} of gguf-py (relative to the row maximum)");
        }
    }
    assert!(failures.is_empty(), "sluice's dequantization differs from gguf-py's:\n{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------------------
// (b) Quantized matmul against f64 dot products of gguf-py's values

/// How llama.cpp (and sluice) quantize activations for a weight type (the type's
/// "vec_dot_type" in ggml): `Some((block, f16_scale, block_sum))`, `None` for float weights.
///
/// * Q8_0 (block 32): `d = max|x|/127` stored as f16, `q = round(x/d)`.
/// * Q8_1 (block 32): as Q8_0, plus `s = f16(d·Σq)` for formats with a block minimum.
/// * Q8_K (block 256): `d = max/127` kept in f32, `q = round(x/d)`.
fn activation_format(d: DType) -> Option<(usize, bool, bool)> {
    match d.name() {
        "F32" | "F16" | "BF16" => None,
        "Q4_0" | "Q5_0" | "Q8_0" | "MXFP4" | "IQ4_NL" => Some((32, true, false)),
        "Q4_1" | "Q5_1" => Some((32, true, true)),
        // Q2_K … Q6_K and the IQ formats (IQ4_NL aside).
        _ => Some((256, false, false)),
    }
}

/// Per block of a weight row, an upper bound on the magnitude of the block minimum term
/// (`M` with each value `w = a − b`, `0 ≤ |b| ≤ M`), read from the raw block: Q4_1/Q5_1 store
/// `m` (f16 at byte 2); Q4_K/Q5_K store `dmin` (f16 at byte 2) times 6-bit mins (≤ 63); Q2_K
/// `dmin` (f16 at byte 82) times 4-bit mins (≤ 15). Zero for formats without a minimum.
fn block_min_bound(d: DType, block: &[u8]) -> f64 {
    let f16_at = |i: usize| half::f16::from_bits(u16::from_le_bytes([block[i], block[i + 1]])).to_f64().abs();
    match d {
        DType::Q4_1 | DType::Q5_1 => f16_at(2),
        DType::Q4_K | DType::Q5_K => 63.0 * f16_at(2),
        DType::Q2_K => 15.0 * f16_at(82),
        _ => 0.0,
    }
}

const U: f64 = 1.0 / (1u64 << 24) as f64; // f32 unit roundoff
const F16_U: f64 = 1.0 / (1u64 << 11) as f64; // f16 unit roundoff (normal range)
const F16_MIN_NORMAL: f64 = 1.0 / (1u64 << 14) as f64;

/// Bound on |sluice's quantized dot − Σ_i w_i·x_i| (exact, f64) for weight row `raw` (gguf-py
/// values `w`) and f32 activations `x`.
///
/// The kernels replace `x` by its 8-bit quantization x̂ and then compute Σ w_i·x̂_i from exact
/// integer sums, so
///
///   |result − Σ w·x| ≤ Σ_i |w_i|·|x̂_i − x_i|                               (quantization)
///                    + Q8_1 only: Σ_blocks |m|·|s − Σ x̂|                   (rounded block sum)
///                    + γ·Σ_i (|w_i| + 2·M_i)·(|x_i| + e_i)                 (float rounding)
///
/// with, per activation block of largest magnitude A and D = A/127:
///
/// * Q8_0/Q8_1: `q = round(x·(1/d))` with d = D rounded to f32, then d stored as f16:
///   |x̂ − x| ≤ d·(½ + 3u·127) + |d16 − d|·127 ≤ D·(½ + 127·2^-11 + 400u) =: e  (d normal in
///   f16, which `activations` ensures: every block's D is at least 2^-14).
/// * Q8_K: d = 1/(−127/max) in f32 and `q = round_half_even(x·(−127/max))`, never clamped
///   (|x·127/max| ≤ 127): |x̂ − x| ≤ D·(½ + 400u).
/// * Q8_1's `s = f16(d·Σq)` stands in for Σ x̂ = d16·Σq in the min term `m·s`:
///   |s − d16·Σq| ≤ 2^-11·|d·Σq| + |d − d16|·|Σq| + 2^-25 (f16 subnormal spacing) and
///   |d·Σq| ≤ |Σx| + 32·d·(½ + 400u).
/// * Float rounding: each block adds `fma(d·dx, isum, acc)` (and for minimum formats
///   `fma(−dmin·dx, mins, acc)`): two roundings for the scale product and the int→f32
///   conversion, one per fused step, over 2·blocks steps, each term bounded by the parts of
///   w = a − b it multiplies (|a| ≤ |w| + M, |b| ≤ M); gguf-py's own rounding of w (two
///   roundings per value) and the f64 reference are inside the same allowance:
///   γ = (2·blocks + 9)·u.
/// * IQ formats: a block's values are `w = D·s·c` exactly (see `exact_dequantization`), and the
///   kernels add `fma(D·dx, Σ s·c·q, acc)` once per block from an exact integer sum, which is
///   the plain case above (no minimum: IQ1's ±⅛ delta is part of its integer codes, not a
///   second term). Their scales do not enter the bound beyond `|w|`: `D·dx` rounds once
///   (relative u) and `Σ s·c·q` converts with one rounding even where it passes 2^24 (IQ4_XS
///   sums reach 2^27), each relative to |Σ w·x̂| ≤ Σ |w|·(|x| + e), inside γ.
fn quant_bound(d: DType, raw: &[u8], w: &[f32], x: &[f32]) -> f64 {
    let (ab, f16_scale, block_sum) = activation_format(d).expect("a block format");
    let (be, bb) = (d.block_elems(), d.block_bytes());
    let c = if f16_scale { 0.5 + 127.0 * F16_U + 400.0 * U } else { 0.5 + 400.0 * U };
    let n_steps = 2 * (w.len() / be.min(ab)) + 9;
    let gamma = n_steps as f64 * U;
    let mut total = 0.0;
    for (b, (wb, xb)) in w.chunks_exact(ab).zip(x.chunks_exact(ab)).enumerate() {
        let amax = xb.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        let dd = amax / 127.0;
        if f16_scale {
            assert!(dd == 0.0 || dd >= F16_MIN_NORMAL, "activation block {b}: scale {dd:e} is not a normal f16");
        }
        let e = c * dd;
        for (k, (wi, xi)) in wb.iter().zip(xb).enumerate() {
            let i = b * ab + k;
            let m = block_min_bound(d, &raw[i / be * bb..(i / be + 1) * bb]);
            let (wi, xi) = (wi.abs() as f64, xi.abs() as f64);
            total += wi * e + gamma * (wi + 2.0 * m) * (xi + e);
        }
        if block_sum {
            // Q4_1/Q5_1 weight blocks are 32 wide, as the activation blocks.
            let m = block_min_bound(d, &raw[b * bb..(b + 1) * bb]);
            let sx: f64 = xb.iter().map(|v| *v as f64).sum();
            let ds = sx.abs() + 32.0 * dd * (0.5 + 400.0 * U);
            total += m * (2.0 * F16_U * (1.0 + F16_U) * ds + 1.0 / (1u64 << 25) as f64);
        }
    }
    total
}

/// Bound for float weights: sluice widens the weights exactly and sums products of f32 values
/// with fused multiply-adds in some fixed order: any order of `cols` fused steps (plus the
/// final lane sums) is within γ_{cols+4}·Σ|w·x|, plus the spacing of f32 subnormals per step
/// (the BF16 fixture has subnormal rows).
fn float_bound(w: &[f32], x: &[f32]) -> f64 {
    let s: f64 = w.iter().zip(x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
    let k = (w.len() + 4) as f64;
    k * U * (1.0 + 2.0 * k * U) * s + k * f64::from(f32::from_bits(1))
}

fn bound(d: DType, raw: &[u8], w: &[f32], x: &[f32]) -> f64 {
    if d.is_float() {
        float_bound(w, x)
    } else {
        quant_bound(d, raw, w, x)
    }
}

/// Fixed pseudo-random activations: `n` rows of `cols`, uniform in ±1 times a per-32-block
/// gain (so blocks differ in scale by up to 160×, as real hidden states do), with one outlier
/// per row. Every block's largest magnitude keeps the Q8_0 scale a normal f16.
fn activations(n: usize, cols: usize, seed: u64) -> Vec<f32> {
    const GAINS: [f32; 7] = [1.0, 0.3, 2.5, 0.05, 8.0, 0.7, 1.6];
    let mut s = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        // xorshift64*
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        ((s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let mut x = vec![0f32; n * cols];
    for (t, row) in x.chunks_exact_mut(cols).enumerate() {
        for (i, v) in row.iter_mut().enumerate() {
            *v = next() * GAINS[(i / 32 + t) % GAINS.len()];
        }
        let at = (t * 331 + 17) % cols;
        row[at] = if t % 2 == 0 { 12.0 } else { -9.5 };
    }
    x
}

/// Token counts: a single token (the decode kernels), a few (the row kernels; the tiled
/// kernel where AVX-512 VNNI is present) and more than one tile of 16.
const TOKENS: [usize; 3] = [1, 7, 20];

/// Runs sluice's matmul on `raw` rows and returns, for every (token, row), the ratio of the
/// error against the f64 reference of gguf-py's values to the bound (≤ 1 passes).
fn error_ratios(d: DType, f: &Fixture, raw: &[u8], x: &[f32], n: usize) -> Result<Vec<f64>, String> {
    let m = MatRef::new(d, f.rows, f.cols, raw).map_err(|e| e.to_string())?;
    let mut out = vec![0f32; n * f.rows];
    matmul(&ThreadPool::new(2), m, x, n, &mut out);
    let mut got = Vec::with_capacity(out.len());
    let mut want = Vec::with_capacity(out.len());
    let mut bounds = Vec::with_capacity(out.len());
    for t in 0..n {
        let xt = &x[t * f.cols..(t + 1) * f.cols];
        for r in 0..f.rows {
            let w = f.values_row(r);
            got.push(out[t * f.rows + r] as f64);
            want.push(w.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>());
            bounds.push(bound(d, f.raw_row(r), w, xt));
        }
    }
    // Lengths and NaNs are checked once for the whole result.
    compare::max_abs_diff_f64(&got, &want)?;
    Ok(got.iter().zip(&want).zip(&bounds).map(|((g, w), b)| (g - w).abs() / b).collect())
}

#[test]
fn matmul_is_within_the_activation_quantization_bound_of_gguf_py() {
    let mut failures = Vec::new();
    for (d, f) in known() {
        // The bound assumes ggml's pairing of weight and activation formats; sluice must
        // quantize activations in blocks of the same size.
        let sluice_block = quant::act::ActKind::for_weights(d).map(|k| k.block());
        if sluice_block != activation_format(d).map(|a| a.0) {
            failures.push(format!("{d}: sluice quantizes activations in blocks of {sluice_block:?}, ggml does not"));
            continue;
        }
        let mut line = format!("{d}:");
        for n in TOKENS {
            let x = activations(n, f.cols, 7);
            match error_ratios(d, &f, &f.raw, &x, n) {
                Ok(ratios) => {
                    let worst = ratios.iter().fold(0f64, |m, v| m.max(*v));
                    line += &format!(" {n} token(s) worst error {worst:.3} of the bound;");
                    if worst > 1.0 {
                        let at = ratios.iter().position(|v| *v == worst).unwrap();
                        failures.push(format!(
                            "{d}, {n} tokens: token {} row {} error is {worst:.3} × the bound",
                            at / f.rows,
                            at % f.rows
                        ));
                    }
                }
                Err(e) => failures.push(format!("{d}, {n} tokens: {e}")),
            }
        }
        eprintln!("{line}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_wrong_decoder_breaks_the_matmul_bound() {
    // The bound must be tight enough to matter: the same rows corrupted the way a decoder
    // with a plausible bug would read them must fall outside it.
    let mut failures = Vec::new();
    for (d, f) in known() {
        let corruptions = corruptions(d);
        if corruptions.is_empty() {
            eprintln!("{d}: no corruptions defined for this type (add some to `corruptions`)");
            continue;
        }
        let n = 20;
        let x = activations(n, f.cols, 11);
        for (name, how) in corruptions {
            let mut raw = f.raw.clone();
            match how {
                Corrupt::EachBlock(g) => raw.chunks_exact_mut(d.block_bytes()).for_each(g),
                Corrupt::NeighbourBlocks(bytes) => {
                    for pair in raw.chunks_exact_mut(2 * d.block_bytes()) {
                        let (a, b) = pair.split_at_mut(d.block_bytes());
                        a[bytes.clone()].swap_with_slice(&mut b[bytes.clone()]);
                    }
                }
            }
            assert_ne!(raw, f.raw, "{d} {name}: the corruption changed nothing");
            match error_ratios(d, &f, &raw, &x, n) {
                Ok(ratios) => {
                    let worst = ratios.iter().fold(0f64, |m, v| m.max(*v));
                    let over = ratios.iter().filter(|v| **v > 1.0).count();
                    eprintln!(
                        "{d} {name}: worst error {worst:.1} × the bound; {over} of {} results outside it",
                        ratios.len()
                    );
                    if worst <= 1.0 {
                        failures.push(format!("{d} {name}: a decoder reading blocks this way would pass"));
                    }
                }
                // A NaN or an infinity from a corrupted scale fails the comparison as well.
                Err(e) => eprintln!("{d} {name}: caught ({e})"),
            }
        }
    }
    assert!(failures.is_empty(), "the matmul bound misses these wrong decoders:\n{}", failures.join("\n"));
}

/// A corruption of the fixture's blocks.
enum Corrupt {
    /// Applied to every block.
    EachBlock(fn(&mut [u8])),
    /// These bytes exchanged between blocks 2k and 2k+1 (each block gets its neighbour's).
    NeighbourBlocks(std::ops::Range<usize>),
}

fn swap_nibbles(b: &mut [u8]) {
    for v in b {
        *v = v.rotate_left(4);
    }
}

/// Exchanges the 2-bit fields 0↔1 and 2↔3 of each byte.
fn swap_crumbs(b: &mut [u8]) {
    for v in b {
        *v = ((*v & 0x33) << 2) | ((*v >> 2) & 0x33);
    }
}

/// Exchanges bytes 2k and 2k+1.
fn swap_pairs(b: &mut [u8]) {
    for p in b.chunks_exact_mut(2) {
        p.swap(0, 1);
    }
}

/// What a decoder with a plausible bug effectively sees: codes of neighbouring elements
/// exchanged (nibble order, 2-bit field order, byte order), a neighbour's scale, a dropped
/// sign or high bit, a minimum added instead of subtracted, an E8M0 scale not halved.
fn corruptions(d: DType) -> Vec<(&'static str, Corrupt)> {
    use Corrupt::{EachBlock as B, NeighbourBlocks as N};
    fn each(f: fn(&mut [u8])) -> Corrupt {
        B(f)
    }
    match d {
        DType::F16 | DType::BF16 => vec![
            ("bytes of each element swapped", each(swap_pairs)),
            ("sign bit ignored", each(|b| b.chunks_exact_mut(2).for_each(|p| p[1] &= 0x7f))),
        ],
        DType::Q4_0 => vec![
            ("nibbles swapped", each(|b| swap_nibbles(&mut b[2..18]))),
            ("neighbouring block's scale", N(0..2)),
            ("sign of d dropped", each(|b| b[1] &= 0x7f)),
        ],
        DType::Q4_1 => vec![
            ("nibbles swapped", each(|b| swap_nibbles(&mut b[4..20]))),
            ("neighbouring block's scale", N(0..2)),
            ("minimum's sign flipped", each(|b| b[3] ^= 0x80)),
        ],
        DType::Q5_0 => vec![
            ("nibbles swapped", each(|b| swap_nibbles(&mut b[6..22]))),
            ("neighbouring block's scale", N(0..2)),
            ("fifth bits dropped", each(|b| b[2..6].fill(0))),
        ],
        DType::Q5_1 => vec![
            ("nibbles swapped", each(|b| swap_nibbles(&mut b[8..24]))),
            ("neighbouring block's scale", N(0..2)),
            ("fifth bits dropped", each(|b| b[4..8].fill(0))),
            ("minimum's sign flipped", each(|b| b[3] ^= 0x80)),
        ],
        DType::Q8_0 => vec![
            ("adjacent codes swapped", each(|b| swap_pairs(&mut b[2..34]))),
            ("neighbouring block's scale", N(0..2)),
            ("codes read as unsigned", each(|b| b[2..34].iter_mut().for_each(|v| *v ^= 0x80))),
        ],
        DType::MXFP4 => vec![
            ("nibbles swapped", each(|b| swap_nibbles(&mut b[1..17]))),
            ("neighbouring block's scale", N(0..1)),
            ("scale not halved", each(|b| b[0] = b[0].saturating_add(1))),
        ],
        DType::Q2_K => vec![
            ("2-bit codes swapped", each(|b| swap_crumbs(&mut b[16..80]))),
            ("neighbouring sub-block's scale and min", each(|b| swap_pairs(&mut b[0..16]))),
            ("minimum's sign flipped", each(|b| b[83] ^= 0x80)),
        ],
        DType::Q3_K => vec![
            ("2-bit codes swapped", each(|b| swap_crumbs(&mut b[32..96]))),
            ("neighbouring sub-block's scale", each(|b| swap_pairs(&mut b[96..104]))),
            ("high-bit mask inverted", each(|b| b[0..32].iter_mut().for_each(|v| *v = !*v))),
        ],
        DType::Q4_K => vec![
            ("nibbles swapped", each(|b| swap_nibbles(&mut b[16..144]))),
            ("neighbouring sub-block's scale and min", each(|b| swap_pairs(&mut b[4..12]))),
            ("minimum's sign flipped", each(|b| b[3] ^= 0x80)),
        ],
        DType::Q5_K => vec![
            ("nibbles swapped", each(|b| swap_nibbles(&mut b[48..176]))),
            ("neighbouring sub-block's scale and min", each(|b| swap_pairs(&mut b[4..12]))),
            ("fifth bits dropped", each(|b| b[16..48].fill(0))),
            ("minimum's sign flipped", each(|b| b[3] ^= 0x80)),
        ],
        DType::Q6_K => vec![
            ("nibbles swapped", each(|b| swap_nibbles(&mut b[0..128]))),
            ("neighbouring sub-block's scale", each(|b| swap_pairs(&mut b[192..208]))),
            ("high 2-bit fields swapped", each(|b| swap_crumbs(&mut b[128..192]))),
        ],
        DType::IQ4_NL => vec![
            ("nibbles swapped", each(|b| swap_nibbles(&mut b[2..18]))),
            ("neighbouring block's scale", N(0..2)),
            ("levels read in reverse", each(|b| b[2..18].iter_mut().for_each(|v| *v ^= 0xff))),
        ],
        DType::IQ4_XS => vec![
            ("nibbles swapped", each(|b| swap_nibbles(&mut b[8..136]))),
            ("neighbouring group's scale", each(|b| swap_nibbles(&mut b[4..8]))),
            ("high scale bits dropped", each(|b| b[2..4].fill(0))),
        ],
        DType::IQ3_XXS => vec![
            ("neighbouring grid indices swapped", each(|b| swap_pairs(&mut b[2..66]))),
            ("sign fields dropped", each(|b| b[66..98].chunks_exact_mut(4).for_each(|w| w[0..3].fill(0)))),
            ("neighbouring group's scale", each(|b| swap_u32_tops(&mut b[66..98]))),
        ],
        DType::IQ3_S => vec![
            ("neighbouring grid indices swapped", each(|b| swap_pairs(&mut b[2..66]))),
            ("ninth index bits dropped", each(|b| b[66..74].fill(0))),
            ("sign bits dropped", each(|b| b[74..106].fill(0))),
            ("neighbouring group's scale", each(|b| swap_nibbles(&mut b[106..110]))),
        ],
        DType::IQ2_XXS => vec![
            (
                "neighbouring grid indices swapped",
                each(|b| b[2..66].chunks_exact_mut(8).for_each(|g| swap_pairs(&mut g[0..4]))),
            ),
            ("sign fields dropped", each(|b| b[2..66].chunks_exact_mut(8).for_each(|g| g[4..7].fill(0)))),
            ("neighbouring group's scale", each(|b| swap_u32_tops_stride(&mut b[2..66]))),
        ],
        DType::IQ2_XS => vec![
            ("ninth index bits dropped", each(|b| b[2..66].chunks_exact_mut(2).for_each(|q| q[1] &= 0xfe))),
            ("sign fields dropped", each(|b| b[2..66].chunks_exact_mut(2).for_each(|q| q[1] &= 0x01))),
            ("neighbouring half-group's scale", each(|b| swap_nibbles(&mut b[66..74]))),
        ],
        DType::IQ2_S => vec![
            ("high index bits dropped", each(|b| b[66..74].fill(0))),
            ("signs inverted", each(|b| b[34..66].iter_mut().for_each(|v| *v = !*v))),
            ("neighbouring half-group's scale", each(|b| swap_nibbles(&mut b[74..82]))),
        ],
        DType::IQ1_S => vec![
            (
                "high index bits dropped",
                each(|b| {
                    b[34..50].chunks_exact_mut(2).for_each(|q| {
                        q[0] = 0;
                        q[1] &= 0xf0
                    })
                }),
            ),
            ("delta's sign flipped", each(|b| b[34..50].chunks_exact_mut(2).for_each(|q| q[1] ^= 0x80))),
            ("neighbouring grid indices swapped", each(|b| swap_pairs(&mut b[2..34]))),
        ],
        DType::IQ1_M => vec![
            ("high index bits dropped", each(|b| b[32..48].iter_mut().for_each(|v| *v &= 0x88))),
            ("delta's sign flipped", each(|b| b[32..48].iter_mut().for_each(|v| *v ^= 0x88))),
            ("neighbouring grid indices swapped", each(|b| swap_pairs(&mut b[0..32]))),
            ("neighbouring half-group's scale", each(|b| b[48..56].chunks_exact_mut(2).for_each(swap_3bit_fields))),
        ],
        _ => Vec::new(),
    }
}

/// Exchanges the top nibbles (the 4-bit scales) of consecutive u32 words 2k and 2k+1.
fn swap_u32_tops(b: &mut [u8]) {
    for p in b.chunks_exact_mut(8) {
        let (a, c) = (p[3] & 0xf0, p[7] & 0xf0);
        p[3] = (p[3] & 0x0f) | c;
        p[7] = (p[7] & 0x0f) | a;
    }
}

/// As `swap_u32_tops` for IQ2_XXS groups: the scale is the top nibble of byte 7 of each
/// 8-byte group; groups 2k and 2k+1 exchange theirs.
fn swap_u32_tops_stride(b: &mut [u8]) {
    for p in b.chunks_exact_mut(16) {
        let (a, c) = (p[7] & 0xf0, p[15] & 0xf0);
        p[7] = (p[7] & 0x0f) | c;
        p[15] = (p[15] & 0x0f) | a;
    }
}

/// Exchanges the 3-bit fields 0↔1 and 2↔3 of a little-endian u16 (IQ1_M's scales), keeping
/// the top nibble (a piece of the block's f16 scale).
fn swap_3bit_fields(q: &mut [u8]) {
    let v = u16::from_le_bytes([q[0], q[1]]);
    let f = |i: u16| (v >> (3 * i)) & 7;
    let w = (v & 0xf000) | f(1) | (f(0) << 3) | (f(3) << 6) | (f(2) << 9);
    q.copy_from_slice(&w.to_le_bytes());
}
