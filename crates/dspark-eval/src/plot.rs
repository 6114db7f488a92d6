//! Small SVG line charts: one panel per group, one line per series.

pub struct Panel {
    pub title: String,
    pub series: Vec<(String, Vec<(f64, f64)>)>,
}

const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#7f7f7f"];

/// Panels side by side sharing axes; `y` fixes the vertical range (else from the data).
pub fn lines_svg(title: &str, panels: &[Panel], xlabel: &str, ylabel: &str, y: Option<(f64, f64)>) -> String {
    let (pw, ph, pad) = (300.0, 240.0, 46.0);
    let width = pad + panels.len().max(1) as f64 * (pw + pad);
    let height = ph + 2.0 * pad + 40.0 + 16.0 * panels.first().map_or(0, |p| p.series.len()) as f64;
    let pts = panels.iter().flat_map(|p| p.series.iter().flat_map(|s| s.1.iter()));
    let (mut x0, mut x1, mut y0, mut y1) =
        (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, v) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(v);
        y1 = y1.max(v);
    }
    if !x0.is_finite() {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let (y0, y1) = y.unwrap_or((y0.min(0.0).floor(), (y1 * 1.1).max(y0 + 1e-9)));
    let mut s = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-family='sans-serif' font-size='11'>\n\
         <rect width='100%' height='100%' fill='white'/>\n<text x='{pad}' y='20' font-size='14'>{title}</text>\n"
    );
    for (i, p) in panels.iter().enumerate() {
        let ox = pad + i as f64 * (pw + pad);
        let oy = 40.0;
        let sx = |x: f64| ox + (x - x0) / (x1 - x0) * pw;
        let sy = |v: f64| oy + ph - (v - y0) / (y1 - y0) * ph;
        s += &format!("<rect x='{ox}' y='{oy}' width='{pw}' height='{ph}' fill='none' stroke='#999'/>\n");
        s += &format!("<text x='{}' y='{}'>{}</text>\n", ox + 4.0, oy + 14.0, p.title);
        for t in 0..=4 {
            let v = y0 + (y1 - y0) * t as f64 / 4.0;
            s += &format!("<text x='{}' y='{:.1}' text-anchor='end'>{v:.2}</text>\n", ox - 4.0, sy(v) + 4.0);
            let xv = x0 + (x1 - x0) * t as f64 / 4.0;
            s += &format!(
                "<text x='{:.1}' y='{}' text-anchor='middle'>{xv:.0}</text>\n",
                sx(xv),
                oy + ph + 14.0
            );
        }
        s += &format!(
            "<text x='{}' y='{}' text-anchor='middle'>{xlabel}</text>\n",
            ox + pw / 2.0,
            oy + ph + 30.0
        );
        if i == 0 {
            s += &format!(
                "<text x='12' y='{}' transform='rotate(-90 12 {})' text-anchor='middle'>{ylabel}</text>\n",
                oy + ph / 2.0,
                oy + ph / 2.0
            );
        }
        for (k, (name, pts)) in p.series.iter().enumerate() {
            let c = COLORS[k % COLORS.len()];
            let line: Vec<String> = pts.iter().map(|&(x, v)| format!("{:.1},{:.1}", sx(x), sy(v))).collect();
            s += &format!(
                "<polyline points='{}' fill='none' stroke='{c}' stroke-width='2'/>\n",
                line.join(" ")
            );
            for &(x, v) in pts {
                s += &format!("<circle cx='{:.1}' cy='{:.1}' r='2.5' fill='{c}'/>\n", sx(x), sy(v));
            }
            if i == 0 {
                let ly = oy + ph + 44.0 + 16.0 * k as f64;
                s += &format!("<rect x='{ox}' y='{}' width='14' height='3' fill='{c}'/><text x='{}' y='{ly}'>{name}</text>\n", ly - 4.0, ox + 20.0);
            }
        }
    }
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_one_line_per_series_per_panel() {
        let p = |t: &str| Panel {
            title: t.into(),
            series: vec![("a".into(), vec![(1.0, 0.5), (2.0, 0.4)]), ("b".into(), vec![(1.0, 0.9)])],
        };
        let svg = lines_svg("t", &[p("math"), p("code")], "x", "y", Some((0.0, 1.0)));
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert!(svg.contains("math") && svg.contains("code"));
    }
}
