//! Comparisons of float results that cannot pass vacuously: lengths must agree and a NaN on
//! either side is a failure, never silently skipped (`f32::max` ignores NaN, and `zip` stops
//! at the shorter slice). Tests and the tools that print errors use these.

/// Whether `a` and `b` have the same length and every element the same bits.
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Where two slices first differ in bits, if they do (a length mismatch is a difference at
/// the shorter length).
pub fn first_difference(a: &[f32], b: &[f32]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits()).or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

/// The largest |a[i] − b[i]|, or an error if the lengths differ or either side holds a NaN
/// (an infinity on one side only is an infinite difference; equal infinities differ by 0).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> Result<f32, String> {
    if a.len() != b.len() {
        return Err(format!("lengths differ: {} vs {}", a.len(), b.len()));
    }
    let mut m = 0f32;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x.is_nan() || y.is_nan() {
            return Err(format!("NaN at index {i} ({x} vs {y})"));
        }
        let d = if x == y { 0.0 } else { (x - y).abs() };
        if d.is_nan() || d > m {
            m = if d.is_nan() { f32::INFINITY } else { d };
        }
    }
    Ok(m)
}

/// `max_abs_diff` in f64.
pub fn max_abs_diff_f64(a: &[f64], b: &[f64]) -> Result<f64, String> {
    if a.len() != b.len() {
        return Err(format!("lengths differ: {} vs {}", a.len(), b.len()));
    }
    let mut m = 0f64;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x.is_nan() || y.is_nan() {
            return Err(format!("NaN at index {i} ({x} vs {y})"));
        }
        let d = if x == y { 0.0 } else { (x - y).abs() };
        m = if d.is_nan() { f64::INFINITY } else { m.max(d) };
    }
    Ok(m)
}

/// log-softmax of a row in f64 (for comparing distributions whose logits may differ by a
/// constant, as llama.cpp's reported log-probabilities do).
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f64::NEG_INFINITY, |m, v| m.max(*v as f64));
    let s: f64 = row.iter().map(|v| (*v as f64 - m).exp()).sum();
    let lse = m + s.ln();
    row.iter().map(|v| *v as f64 - lse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_and_nans_are_failures() {
        assert!(max_abs_diff(&[1.0, 2.0], &[1.0]).is_err());
        assert!(max_abs_diff(&[1.0, f32::NAN], &[1.0, 2.0]).is_err());
        assert!(max_abs_diff(&[f32::NAN], &[f32::NAN]).is_err());
        assert_eq!(max_abs_diff(&[1.0, 2.0], &[1.5, 2.0]).unwrap(), 0.5);
        assert_eq!(max_abs_diff(&[f32::INFINITY], &[1.0]).unwrap(), f32::INFINITY);
        assert_eq!(max_abs_diff(&[f32::INFINITY], &[f32::INFINITY]).unwrap(), 0.0);
        assert!(max_abs_diff_f64(&[0.0], &[f64::NAN]).is_err());
        assert!(!same_bits(&[1.0, 2.0], &[1.0]));
        assert!(!same_bits(&[f32::NAN], &[0.0]));
        assert_eq!(first_difference(&[1.0, 2.0], &[1.0]), Some(1));
        assert_eq!(first_difference(&[1.0, 2.0], &[1.0, 3.0]), Some(1));
        assert_eq!(first_difference(&[1.0], &[1.0]), None);
    }

    #[test]
    fn log_softmax_sums_to_one() {
        let l = log_softmax(&[1.0, 2.0, 3.0]);
        let s: f64 = l.iter().map(|v| v.exp()).sum();
        assert!((s - 1.0).abs() < 1e-12);
        assert!((l[2] - l[1] - 1.0).abs() < 1e-12);
    }
}
