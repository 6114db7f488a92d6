//! The machine's cost curve, measured once: seconds per target forward at B verify tokens and
//! seconds per drafting round at R sequences. SPS(B) (forward steps per second) is what
//! Algorithm 1 trades expected accepted tokens against.

use crate::ScheduleError;
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CostTable {
    /// The target model the table was measured for.
    pub model: String,
    /// The drafter measured alongside, if any.
    pub drafter: Option<String>,
    pub threads: usize,
    /// `(B, seconds)`: one target forward over B new tokens, ascending in B.
    pub forward: Vec<(usize, f64)>,
    /// `(R, seconds)`: one drafting round for R sequences, ascending in R.
    #[serde(default)]
    pub draft: Vec<(usize, f64)>,
}

/// Piecewise-linear in the measured points; flat below the first, extrapolated from the last
/// two above the last (per-token cost keeps growing once compute-bound).
fn interpolate(points: &[(usize, f64)], x: usize) -> f64 {
    match points {
        [] => 0.0,
        [(_, y)] => *y,
        _ => {
            let x = x as f64;
            let seg = points.windows(2).find(|w| x <= w[1].0 as f64).unwrap_or(&points[points.len() - 2..]);
            let ((x0, y0), (x1, y1)) = ((seg[0].0 as f64, seg[0].1), (seg[1].0 as f64, seg[1].1));
            if x <= x0 {
                return y0;
            }
            (y0 + (y1 - y0) * (x - x0) / (x1 - x0)).max(f64::MIN_POSITIVE)
        }
    }
}

impl CostTable {
    /// No measurements, for the policies that weigh no costs (fixed, threshold); every cost
    /// reads 0.
    pub fn unmeasured() -> Self {
        Self { model: String::new(), drafter: None, threads: 1, forward: vec![], draft: vec![] }
    }

    /// Seconds for one target forward over `b` tokens.
    pub fn forward_s(&self, b: usize) -> f64 {
        interpolate(&self.forward, b.max(1))
    }

    /// Target forward steps per second at `b` verify tokens.
    pub fn sps(&self, b: usize) -> f64 {
        1.0 / self.forward_s(b)
    }

    /// Seconds for one drafting round over `r` sequences (0 without a drafter).
    pub fn draft_s(&self, r: usize) -> f64 {
        if r == 0 {
            0.0
        } else {
            interpolate(&self.draft, r)
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        for (what, pts) in [("forward", &self.forward), ("draft", &self.draft)] {
            if what == "forward" && pts.is_empty() {
                return Err("no forward timings".into());
            }
            if pts.windows(2).any(|w| w[0].0 >= w[1].0) {
                return Err(format!("{what} sizes must be strictly ascending"));
            }
            if pts.iter().any(|&(n, s)| n == 0 || !(s.is_finite() && s > 0.0)) {
                return Err(format!("{what} timings must be positive, at sizes ≥ 1"));
            }
        }
        Ok(())
    }

    pub fn load(path: &Path) -> Result<Self, ScheduleError> {
        let err = |reason: String| ScheduleError::Table { path: path.display().to_string(), reason };
        let text = std::fs::read_to_string(path)
            .map_err(|e| err(format!("{e}; create one with `dspark profile`")))?;
        let t: Self = serde_json::from_str(&text).map_err(|e| err(format!("not a cost table: {e}")))?;
        t.validate().map_err(err)?;
        Ok(t)
    }

    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        std::fs::write(path, serde_json::to_string_pretty(self).expect("serialisable") + "\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> CostTable {
        CostTable {
            model: "m".into(),
            drafter: None,
            threads: 2,
            forward: vec![(1, 0.010), (2, 0.012), (4, 0.020)],
            draft: vec![(1, 0.004), (4, 0.010)],
        }
    }

    #[test]
    fn interpolates_and_extrapolates() {
        let t = table();
        assert!((t.forward_s(1) - 0.010).abs() < 1e-12);
        assert!((t.forward_s(3) - 0.016).abs() < 1e-12);
        assert!((t.forward_s(6) - 0.028).abs() < 1e-12, "past the last point: the last slope");
        assert!((t.sps(2) - 1.0 / 0.012).abs() < 1e-9);
        assert!((t.draft_s(2) - 0.006).abs() < 1e-12);
        assert_eq!(t.draft_s(0), 0.0);
    }

    #[test]
    fn refuses_bad_tables() {
        let mut t = table();
        t.forward.swap(0, 1);
        assert!(t.validate().unwrap_err().contains("ascending"));
        let mut t = table();
        t.forward[0].1 = -1.0;
        assert!(t.validate().unwrap_err().contains("positive"));
        let dir = std::env::temp_dir().join(format!("dspark-cost-{}", std::process::id()));
        std::fs::write(&dir, "{not json").unwrap();
        let e = CostTable::load(&dir).unwrap_err().to_string();
        assert!(e.contains("not a cost table"), "{e}");
        table().save(&dir).unwrap();
        assert_eq!(CostTable::load(&dir).unwrap(), table());
        std::fs::remove_file(&dir).ok();
    }
}
