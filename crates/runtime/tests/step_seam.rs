//! The seam through which a whole single-token step runs elsewhere (a GPU in `sluice-cuda`),
//! driven by a stand-in that writes recognizable keys, values and logits: it is asked for
//! exactly the passes it may take (one token of one sequence, experts from the model's own
//! source, nothing observed), its output is what the pass returns, its keys and values are
//! committed to the sequence on success and dropped on failure, and whatever it declines
//! runs on the CPU with the CPU's bits.

use sluice_model::expert::CachedOnly;
use sluice_model::state::LayerState;
use sluice_model::step::StepCompute;
use sluice_model::synth::{builtin_tokenizer, write_model, QuantMix, SynthArch, SynthSpec};
use sluice_model::trace::Observer;
use sluice_model::{BatchItem, Logits, Model, SeqState};
use sluice_runtime::{Engine, EngineOptions};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// What the stand-in does with the steps it is offered.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Take,
    Decline,
    Fail,
}

struct StandIn {
    mode: Mode,
    offered: AtomicUsize,
}

impl StepCompute for StandIn {
    fn step(
        &self,
        m: &Model,
        state: &mut SeqState,
        token: u32,
        want: Logits,
    ) -> Option<sluice_model::Result<(Vec<f32>, Vec<f32>)>> {
        self.offered.fetch_add(1, Ordering::SeqCst);
        match self.mode {
            Mode::Decline => None,
            mode => {
                let kvd = m.cfg.kv_dim();
                let mark = (token * 1000 + state.len() as u32) as f32;
                for l in 0..m.cfg.n_layer {
                    state.append_kv(l, &vec![mark; kvd], &vec![-mark; kvd]);
                }
                if mode == Mode::Fail {
                    return Some(Err(sluice_model::ModelError::Invalid("stand-in failure".into())));
                }
                let logits = if want == Logits::None { Vec::new() } else { vec![mark; m.cfg.vocab_size] };
                Some(Ok((logits, vec![mark; m.cfg.hidden])))
            }
        }
    }

    fn describe(&self) -> String {
        "a stand-in".into()
    }

    fn stats_line(&self) -> String {
        String::new()
    }
}

struct NoOp;
impl Observer for NoOp {
    fn tensor(&mut self, _: &str, _: Option<usize>, _: &[f32], _: usize) {}
}

fn engine(dir: &std::path::Path) -> Engine {
    let mut s = SynthSpec::named("tiny-moe").unwrap();
    s.arch = SynthArch::Qwen3Moe;
    s.n_layer = 2;
    s.quant = QuantMix::Q4KM;
    let path = dir.join("m.gguf");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write_model(&s, builtin_tokenizer(s.vocab), &mut f, |_| {}).unwrap();
    drop(f);
    Engine::load(&path, EngineOptions { threads: 2, max_context: 32, ..Default::default() }).unwrap()
}

fn kv_rows(st: &SeqState, l: usize) -> usize {
    match st.layer(l) {
        LayerState::Kv(kv) => kv.k.len() / kv.k_dim,
        LayerState::Recurrent(_) => panic!("an attention model"),
    }
}

#[test]
fn a_whole_step_takes_exactly_single_token_passes_and_keeps_the_sequence_whole() {
    let dir = sluice_formats::scratch_root().join(format!("sluice-step-seam-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut e = engine(&dir);
    let prompt = [3u32, 9, 27, 81];

    // The plain run, for the passes the stand-in must leave to the CPU.
    let mut plain = e.new_state();
    let plain_prefill = e.model.forward(&mut plain, &prompt, Logits::All, None).unwrap();
    let plain_next = e.model.forward(&mut plain, &[7], Logits::Last, None).unwrap();

    let take = Arc::new(StandIn { mode: Mode::Take, offered: AtomicUsize::new(0) });
    e.model.step_compute = Some(take.clone());
    let mut st = e.new_state();
    // A prefill is several tokens: the CPU's, bit for bit.
    let pre = e.model.forward(&mut st, &prompt, Logits::All, None).unwrap();
    assert_eq!(take.offered.load(Ordering::SeqCst), 0, "a 4-token pass was offered as a step");
    assert!(pre.iter().zip(&plain_prefill).all(|(a, b)| a.to_bits() == b.to_bits()));
    // One token: the stand-in's logits and hidden row; its keys and values committed.
    let (logits, hidden) = e.model.forward_hidden(&mut st, &[7], Logits::Last, None).unwrap();
    let mark = (7 * 1000 + 4) as f32;
    assert_eq!(take.offered.load(Ordering::SeqCst), 1);
    assert!(logits.len() == e.model.cfg.vocab_size && logits.iter().all(|v| *v == mark));
    assert!(hidden.len() == e.model.cfg.hidden && hidden.iter().all(|v| *v == mark));
    assert_eq!(st.len(), 5);
    for l in 0..e.model.cfg.n_layer {
        assert_eq!(kv_rows(&st, l), 5, "layer {l}");
        let (k, v) = st.kv(l);
        let kvd = e.model.cfg.kv_dim();
        assert!(k[4 * kvd..].iter().all(|x| *x == mark) && v[4 * kvd..].iter().all(|x| *x == -mark));
    }

    // Not offered: an observed pass, two sequences at once, experts from another source.
    let before = take.offered.load(Ordering::SeqCst);
    let mut obs = NoOp;
    e.model.forward(&mut st, &[8], Logits::Last, Some(&mut obs)).unwrap();
    let mut a = e.new_state();
    let mut b = e.new_state();
    let mut items = [
        BatchItem { state: &mut a, tokens: &[1], want: Logits::Last },
        BatchItem { state: &mut b, tokens: &[2], want: Logits::Last },
    ];
    e.model.forward_batch(&mut items, None).unwrap();
    let cached = CachedOnly::new(&*e.model.experts, false);
    let mut c = e.new_state();
    e.model.forward_via(&cached, &mut c, &[5], Logits::Last).unwrap();
    assert_eq!(take.offered.load(Ordering::SeqCst), before, "a pass the step may not take was offered");
    assert_eq!((a.len(), b.len(), c.len(), st.len()), (1, 1, 1, 6));

    // A failed step: the error comes back and the sequence is as it was.
    let fail = Arc::new(StandIn { mode: Mode::Fail, offered: AtomicUsize::new(0) });
    e.model.step_compute = Some(fail.clone());
    let err = e.model.forward(&mut st, &[9], Logits::Last, None).unwrap_err().to_string();
    assert!(err.contains("stand-in failure"), "{err}");
    assert_eq!(st.len(), 6);
    assert!((0..e.model.cfg.n_layer).all(|l| kv_rows(&st, l) == 6), "a failed step left keys behind");

    // A declined step runs on the CPU: the plain run's bits.
    let decline = Arc::new(StandIn { mode: Mode::Decline, offered: AtomicUsize::new(0) });
    e.model.step_compute = Some(decline.clone());
    let mut d = e.new_state();
    e.model.forward(&mut d, &prompt, Logits::All, None).unwrap();
    let next = e.model.forward(&mut d, &[7], Logits::Last, None).unwrap();
    assert_eq!(decline.offered.load(Ordering::SeqCst), 1);
    assert!(next.iter().zip(&plain_next).all(|(a, b)| a.to_bits() == b.to_bits()));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_sequence_changes_lineage_when_positions_are_taken_back() {
    let dir = sluice_formats::scratch_root().join(format!("sluice-step-lineage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let e = engine(&dir);
    let mut st = e.new_state();
    let other = e.new_state();
    assert_ne!(st.lineage(), other.lineage(), "two sequences share an identity");
    let l0 = st.lineage();
    e.model.forward(&mut st, &[1, 2, 3], Logits::Last, None).unwrap();
    assert_eq!(st.lineage(), l0, "appending changed the lineage");
    assert_eq!(st.unchanged_below(l0), 3);
    assert_eq!(st.unchanged_below(other.lineage()), 0, "another sequence's copy holds nothing of this one");
    let snap = st.snapshot();
    e.model.forward(&mut st, &[4], Logits::Last, None).unwrap();
    st.truncate(5).unwrap(); // longer than it is: nothing taken back
    assert_eq!(st.lineage(), l0);
    st.truncate(2).unwrap();
    let l1 = st.lineage();
    assert_ne!(l1, l0);
    assert_eq!(l1.0, l0.0, "the identity stays");
    // A copy made before the cut still holds the two positions below it.
    assert_eq!(st.unchanged_below(l0), 2);
    e.model.forward(&mut st, &[3, 9], Logits::Last, None).unwrap();
    assert_eq!((st.unchanged_below(l0), st.unchanged_below(l1)), (2, 4), "positions appended after a cut are new");
    st.restore(&snap).unwrap();
    let l2 = st.lineage();
    assert_ne!(l2, l1);
    // Back at the snapshot's 3 positions: what a copy made before the cut to 2 holds stays 2.
    assert_eq!((st.unchanged_below(l0), st.unchanged_below(l1), st.unchanged_below(l2)), (2, 3, 3));
    // A lineage from the future (another state's counter) is not trusted.
    assert_eq!(st.unchanged_below((l2.0, l2.1 + 1)), 0);
    // Cuts far enough back are forgotten: a copy that old is treated as holding nothing.
    for _ in 0..100 {
        e.model.forward(&mut st, &[5], Logits::Last, None).unwrap();
        st.truncate(3).unwrap();
    }
    assert_eq!((st.unchanged_below(l0), st.unchanged_below(st.lineage())), (0, 3));
    st.reset();
    assert_eq!(st.len(), 0);
    assert_eq!(st.unchanged_below(l2), 0);
    std::fs::remove_dir_all(&dir).ok();
}
