//! SVG plots of a routing trace's statistics (`sluice trace stats --svg DIR`), drawn with
//! plotters: coverage curves, distinct experts per window, hit rate against quota beside
//! Belady's optimum, and a layer × expert heat map.

use anyhow::{Context, Result};
use plotters::prelude::*;
use sluice_experts::trace::stats::TraceStats;
use sluice_experts::trace::QuotaRow;
use sluice_experts::Policy;
use std::path::{Path, PathBuf};

const SIZE: (u32, u32) = (820, 520);
const POLICY_COLORS: [RGBColor; 3] = [RGBColor(31, 119, 180), RGBColor(255, 127, 14), RGBColor(44, 160, 44)];

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing a plot: {e:?}")
}

/// Writes every plot for one trace into `dir`, named after `stem`; returns their paths.
pub fn trace_plots(dir: &Path, stem: &str, title: &str, s: &TraceStats, rows: &[QuotaRow]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let p = |n: &str| dir.join(format!("{stem}-{n}.svg"));
    let out = vec![p("coverage"), p("windows"), p("hit-rate"), p("heat-map")];
    coverage(&out[0], title, s)?;
    windows(&out[1], title, s)?;
    hit_rate(&out[2], title, rows)?;
    heat_map(&out[3], title, s)?;
    Ok(out)
}

fn coverage(path: &Path, title: &str, s: &TraceStats) -> Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let n = s.n_expert as f64;
    let mut c = ChartBuilder::on(&root)
        .caption(format!("{title}: expert coverage per layer"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..n, 0f64..100f64)
        .map_err(err)?;
    c.configure_mesh()
        .x_desc("experts, most used first")
        .y_desc("% of the layer's routing decisions")
        .draw()
        .map_err(err)?;
    let curve = |cov: &[f64]| -> Vec<(f64, f64)> {
        std::iter::once((0.0, 0.0)).chain(cov.iter().enumerate().map(|(i, v)| ((i + 1) as f64, 100.0 * v))).collect()
    };
    for l in &s.layers {
        c.draw_series(LineSeries::new(curve(&l.coverage), BLUE.mix(0.18))).map_err(err)?;
    }
    c.draw_series(LineSeries::new(curve(&s.overall.coverage), BLUE.stroke_width(3)))
        .map_err(err)?
        .label("mean over layers (thin: each layer)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(3)));
    c.draw_series(LineSeries::new(vec![(0.0, 0.0), (n, 100.0)], BLACK.stroke_width(1)))
        .map_err(err)?
        .label("uniform use")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    c.configure_series_labels().position(SeriesLabelPosition::LowerRight).border_style(BLACK).draw().map_err(err)?;
    root.present().map_err(err)
}

fn windows(path: &Path, title: &str, s: &TraceStats) -> Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let w: Vec<_> = s.overall.windows.iter().filter(|w| w.windows > 0).collect();
    let xmax = w.iter().map(|x| x.w).max().unwrap_or(1) as f64;
    let ymax = s.n_expert as f64;
    let mut c = ChartBuilder::on(&root)
        .caption(format!("{title}: distinct experts per window (mean over layers)"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((1f64..xmax.max(2.0)).log_scale(), 0f64..ymax)
        .map_err(err)?;
    c.configure_mesh().x_desc("window (tokens)").y_desc("distinct experts").draw().map_err(err)?;
    let seen: Vec<(f64, f64)> = w.iter().map(|x| (x.w as f64, x.distinct)).collect();
    let uni: Vec<(f64, f64)> = w.iter().map(|x| (x.w as f64, x.uniform_distinct)).collect();
    c.draw_series(LineSeries::new(seen.clone(), BLUE.stroke_width(3)))
        .map_err(err)?
        .label("this trace")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(3)));
    c.draw_series(seen.iter().map(|p| Circle::new(*p, 4, BLUE.filled()))).map_err(err)?;
    c.draw_series(DashedLineSeries::new(uni, 6, 4, BLACK.into()))
        .map_err(err)?
        .label("uniform routing")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    c.configure_series_labels().position(SeriesLabelPosition::UpperLeft).border_style(BLACK).draw().map_err(err)?;
    root.present().map_err(err)
}

fn hit_rate(path: &Path, title: &str, rows: &[QuotaRow]) -> Result<()> {
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let xmax = rows.iter().map(|r| gib(r.bytes)).fold(0.0, f64::max).max(1e-3);
    let mut c = ChartBuilder::on(&root)
        .caption(format!("{title}: hit rate against cache quota"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..xmax * 1.02, 0f64..100f64)
        .map_err(err)?;
    c.configure_mesh().x_desc("expert cache quota (GiB)").y_desc("hit rate (%)").draw().map_err(err)?;
    let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).chain(["belady (optimum)"]).collect();
    for (i, name) in names.iter().enumerate() {
        let pts: Vec<(f64, f64)> = rows.iter().map(|r| (gib(r.bytes), 100.0 * r.results[i].hit_rate)).collect();
        let color = POLICY_COLORS[i % POLICY_COLORS.len()];
        let last = i + 1 == names.len();
        let style = if last { BLACK.stroke_width(3) } else { color.stroke_width(2) };
        c.draw_series(LineSeries::new(pts.clone(), style))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        c.draw_series(pts.iter().map(|p| Circle::new(*p, 3, if last { BLACK.filled() } else { color.filled() })))
            .map_err(err)?;
    }
    c.configure_series_labels().position(SeriesLabelPosition::LowerRight).border_style(BLACK).draw().map_err(err)?;
    root.present().map_err(err)
}

/// Each layer's use of each expert relative to uniform use, on a log₂ scale from ¼× to 4×.
fn heat_map(path: &Path, title: &str, s: &TraceStats) -> Result<()> {
    let root = SVGBackend::new(path, (SIZE.0, SIZE.1.max(120 + 10 * s.layers.len() as u32))).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (ne, nl) = (s.n_expert as i32, s.layers.len() as i32);
    let mut c = ChartBuilder::on(&root)
        .caption(format!("{title}: expert use per layer (log2 of use / uniform, -2..2)"), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0..ne, 0..nl)
        .map_err(err)?;
    c.configure_mesh()
        .disable_mesh()
        .x_desc("expert")
        .y_desc("routed layer (index)")
        .y_label_formatter(&|i| s.layers.get(*i as usize).map_or(String::new(), |l| l.layer.to_string()))
        .draw()
        .map_err(err)?;
    let cells = s.layers.iter().enumerate().flat_map(|(row, l)| {
        let uniform = l.decisions.max(1) as f64 / s.n_expert as f64;
        l.counts.iter().enumerate().map(move |(e, n)| {
            let v = if *n == 0 { -2.0 } else { (*n as f64 / uniform).log2().clamp(-2.0, 2.0) };
            let color = ViridisRGB::get_color_normalized(v, -2.0, 2.0);
            Rectangle::new([(e as i32, row as i32), (e as i32 + 1, row as i32 + 1)], color.filled())
        })
    });
    c.draw_series(cells).map_err(err)?;
    root.present().map_err(err)
}
