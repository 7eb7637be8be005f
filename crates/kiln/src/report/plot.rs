//! Training curves of one or more runs, drawn with plotters into a PNG or an SVG: one panel per
//! quantity (loss, learning rate, each evaluation metric) against the optimizer step, every run in
//! its own colour.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::history::RunHistory;
use crate::error::{KilnError, Result};

/// One panel's size in pixels.
const PANEL: (u32, u32) = (600, 400);
/// Panels a row.
const COLUMNS: usize = 2;
/// Panels a picture holds at most: 32 rows of 400 pixels is already 12,800 pixels tall. 20,000
/// metrics made a picture 4 million pixels tall, and plotters panicked on it after 90 s.
pub const MAX_PANELS: usize = 64;
/// Run colours, in the order the runs are given (Tableau 10).
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
/// Up to this many runs the loss legend names each run's train and eval curve; above it, the runs
/// and the two line styles are listed apart.
const LEGEND_PER_SERIES_MAX_RUNS: usize = 3;

/// Draws the training curves of `runs` into `out` (PNG or SVG by its extension; anything else is
/// an error naming the extension): one panel per quantity against the optimizer step — train loss
/// (with eval loss dashed and marked on the same panel, when present), learning rate, and each
/// eval metric (union over the runs) — every run in its own colour, with a legend naming the runs
/// (and train vs eval where both are drawn). The file is replaced atomically.
///
/// At most [`MAX_PANELS`] panels are drawn, in this order: loss, learning rate, then the eval
/// metrics by name. A warning says in one line how many metrics were left out, from which.
pub fn plot_runs(runs: &[RunHistory], out: &Path) -> Result<()> {
    let format = Format::of(out)?;
    let (panels, left_out) = panels(runs);
    if let Some((count, first)) = left_out {
        tracing::warn!(
            "{}: drew the first {MAX_PANELS} panels; {count} more evaluation metrics, from {} on \
             in name order, were left out",
            super::escape_for_terminal(&out.display().to_string()),
            super::escape_for_terminal(&first)
        );
    }
    if panels.is_empty() {
        let names: Vec<String> = runs.iter().map(|r| r.dir.display().to_string()).collect();
        return Err(KilnError::Data(if runs.is_empty() {
            "nothing to plot: no runs given".to_string()
        } else {
            format!(
                "nothing to plot: no loss, learning_rate or eval_* value with a step was logged by {}",
                names.join(", ")
            )
        }));
    }
    register_font()?;
    let x_max = panels
        .iter()
        .flat_map(|p| &p.series)
        .flat_map(|s| &s.points)
        .map(|&(step, _)| step)
        .max()
        .unwrap_or(0)
        .max(1);
    let drawing_error =
        |e: String| KilnError::Data(format!("{}: drawing the plot: {e}", out.display()));
    let (size, rows, columns) = canvas(panels.len())
        .ok_or_else(|| drawing_error(format!("{} panels do not fit a picture", panels.len())))?;
    match format {
        Format::Svg => {
            let mut svg = String::new();
            {
                let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
                draw(&root, &panels, (rows, columns), x_max)
                    .map_err(|e| drawing_error(e.to_string()))?;
                root.present().map_err(|e| drawing_error(e.to_string()))?;
            }
            crate::io::atomic_write(out, svg.as_bytes())
        }
        Format::Png => {
            let dir = match out.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            std::fs::create_dir_all(dir).map_err(|e| KilnError::io(dir, e))?;
            // The encoder picks the format by the extension, so the temporary name keeps it.
            let tmp = temp_png(out, dir);
            let drawn = (|| {
                let root = BitMapBackend::new(&tmp, size).into_drawing_area();
                draw(&root, &panels, (rows, columns), x_max).map_err(|e| e.to_string())?;
                root.present().map_err(|e| e.to_string())
            })();
            let result = drawn.map_err(drawing_error).and_then(|()| {
                std::fs::File::open(&tmp)
                    .and_then(|f| f.sync_all())
                    .map_err(|e| KilnError::io(&tmp, e))?;
                std::fs::rename(&tmp, out).map_err(|e| KilnError::io(out, e))
            });
            if result.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            result
        }
    }
}

/// The picture's size in pixels, rows and columns for `n` panels; None where a side would not fit
/// a u32 (it cannot, below [`MAX_PANELS`], but the arithmetic is checked all the same).
fn canvas(n: usize) -> Option<((u32, u32), usize, usize)> {
    let columns = n.clamp(1, COLUMNS);
    let rows = n.div_ceil(columns).max(1);
    let width = PANEL.0.checked_mul(u32::try_from(columns).ok()?)?;
    let height = PANEL.1.checked_mul(u32::try_from(rows).ok()?)?;
    Some(((width, height), rows, columns))
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Format {
    Png,
    Svg,
}

impl Format {
    fn of(out: &Path) -> Result<Self> {
        let ext = out.extension().map(|e| e.to_string_lossy().to_lowercase());
        match ext.as_deref() {
            Some("png") => Ok(Self::Png),
            Some("svg") => Ok(Self::Svg),
            Some(other) => Err(KilnError::Data(format!(
                "{}: cannot draw a .{other} file: give a .png or .svg path",
                out.display()
            ))),
            None => Err(KilnError::Data(format!(
                "{}: no file extension: give a .png or .svg path",
                out.display()
            ))),
        }
    }
}

fn temp_png(out: &Path, dir: &Path) -> PathBuf {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned());
    let name = name.unwrap_or_else(|| "plot.png".into());
    dir.join(format!(
        "{}{}-{name}",
        crate::io::files::TEMP_PREFIX,
        std::process::id()
    ))
}

/// plotters draws text with fonts registered by name; kiln embeds DejaVu Sans.
fn register_font() -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(KilnError::Data(
            "the embedded DejaVu Sans font could not be loaded".into(),
        ))
    }
}

/// One curve of one run.
struct Series {
    label: String,
    color: RGBColor,
    points: Vec<(u64, f64)>,
    /// Evaluation points: dashed and marked; else a solid line.
    eval: bool,
}

/// One quantity against the step.
struct Panel {
    title: String,
    y_desc: String,
    series: Vec<Series>,
    /// Extra legend rows for the line styles (many runs with train and eval curves).
    style_legend: bool,
}

/// The panels that have something to draw: loss (train and eval), learning rate, then each eval
/// metric in the runs' union, by name, up to [`MAX_PANELS`]; and how many metrics were left out,
/// with the first of them.
fn panels(runs: &[RunHistory]) -> (Vec<Panel>, Option<(usize, String)>) {
    let names = legend_names(runs);
    let color = |i: usize| PALETTE[i % PALETTE.len()];
    let mut panels = Vec::new();

    let train: Vec<_> = runs.iter().map(|r| r.series("loss")).collect();
    let eval: Vec<_> = runs.iter().map(|r| r.series("eval_loss")).collect();
    let has_train = train.iter().any(|s| !s.is_empty());
    let has_eval = eval.iter().any(|s| !s.is_empty());
    let both = has_train && has_eval;
    let per_series = runs.len() <= LEGEND_PER_SERIES_MAX_RUNS;
    let mut loss = Vec::new();
    for (i, (t, e)) in train.into_iter().zip(eval).enumerate() {
        let label = |kind: &str| match (both, per_series) {
            (true, true) => format!("{} {kind}", names[i]),
            _ => names[i].clone(),
        };
        // With the styles listed apart, each run is named once (on its first curve).
        let eval_label = if both && !per_series && !t.is_empty() {
            String::new()
        } else {
            label("eval")
        };
        if !t.is_empty() {
            loss.push(Series {
                label: label("train"),
                color: color(i),
                points: t,
                eval: false,
            });
        }
        if !e.is_empty() {
            loss.push(Series {
                label: eval_label,
                color: color(i),
                points: e,
                eval: true,
            });
        }
    }
    if !loss.is_empty() {
        let title = match (has_train, has_eval) {
            (true, true) => "Loss (train and eval)",
            (true, false) => "Training loss",
            _ => "Evaluation loss",
        };
        panels.push(Panel {
            title: title.into(),
            y_desc: "loss".into(),
            series: loss,
            style_legend: both && !per_series,
        });
    }

    let single = |key: &str, eval: bool| -> Vec<Series> {
        runs.iter()
            .enumerate()
            .map(|(i, r)| Series {
                label: names[i].clone(),
                color: color(i),
                points: r.series(key),
                eval,
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    };
    let lr = single("learning_rate", false);
    if !lr.is_empty() {
        panels.push(Panel {
            title: "Learning rate".into(),
            y_desc: "learning rate".into(),
            series: lr,
            style_legend: false,
        });
    }

    let mut metrics: Vec<String> = runs.iter().flat_map(|r| r.eval_metrics()).collect();
    metrics.sort();
    metrics.dedup();
    metrics.retain(|k| k != "eval_loss");
    for (i, key) in metrics.iter().enumerate() {
        if panels.len() == MAX_PANELS {
            return (panels, Some((metrics.len() - i, key.clone())));
        }
        let series = single(key, true);
        if !series.is_empty() {
            let name = key.strip_prefix("eval_").unwrap_or(key);
            panels.push(Panel {
                title: format!("Evaluation {}", name.replace('_', " ")),
                y_desc: key.clone(),
                series,
                style_legend: false,
            });
        }
    }
    (panels, None)
}

/// The runs' names, made unique: runs whose folder names clash are named by their paths.
fn legend_names(runs: &[RunHistory]) -> Vec<String> {
    runs.iter()
        .map(|r| {
            if runs.iter().filter(|o| o.name == r.name).count() > 1 {
                r.dir.display().to_string()
            } else {
                r.name.clone()
            }
        })
        .collect()
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    panels: &[Panel],
    grid: (usize, usize),
    x_max: u64,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let cells = root.split_evenly(grid);
    for (panel, area) in panels.iter().zip(&cells) {
        draw_panel(area, panel, x_max)?;
    }
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    x_max: u64,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let (y_lo, y_hi) = y_range(panel);
    // A little room right of the last step, so that its marker is not on the frame.
    let x_hi = x_max.saturating_add((x_max / 50).max(1));
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 20))
        .margin(10)
        .margin_right(20)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(0..x_hi, y_lo..y_hi)?;

    let x_fmt = |v: &u64| format_step(*v, x_max);
    let y_fmt = |v: &f64| format_value(*v, y_lo, y_hi);
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(&panel.y_desc)
        .x_labels(7)
        .y_labels(7)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .light_line_style(TRANSPARENT)
        .bold_line_style(RGBColor(225, 225, 225))
        .draw()?;

    for s in &panel.series {
        let color = s.color;
        let line = color.stroke_width(2);
        // Off-scale values are drawn at the axis' edge (plotters' pixel maths overflows on them).
        let points: Vec<(u64, f64)> = s
            .points
            .iter()
            .map(|&(x, y)| (x, y.clamp(-VALUE_LIMIT, VALUE_LIMIT)))
            .collect();
        // Markers on evaluation points (smaller where they crowd) and on curves too short
        // to show as lines.
        let radius = match (points.len(), s.eval) {
            (0..=2, _) => 4,
            (_, false) => 0,
            (3..=25, true) => 4,
            (26..=60, true) => 2,
            _ => 0,
        };
        let marked = radius > 0;
        if s.eval {
            chart.draw_series(DashedLineSeries::new(points.clone(), 7, 5, line))?;
        } else {
            chart.draw_series(LineSeries::new(points.clone(), line))?;
        }
        let anno = if marked {
            chart.draw_series(
                points
                    .iter()
                    .map(|&p| Circle::new(p, radius, color.filled())),
            )?
        } else {
            // An empty series carries the legend entry.
            chart.draw_series(std::iter::empty::<Circle<(u64, f64), i32>>())?
        };
        // The legend's sample: the line as drawn (dashed for eval), or the marker of a curve
        // too short to show a line.
        if s.label.is_empty() {
        } else if points.len() == 1 {
            anno.label(&s.label)
                .legend(move |(x, y)| Circle::new((x + 12, y), 4, color.filled()));
        } else if s.eval {
            anno.label(&s.label).legend(move |(x, y)| {
                DashedPathElement::new(vec![(x, y), (x + 24, y)], 7, 5, line)
            });
        } else {
            anno.label(&s.label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], line));
        }
    }
    if panel.style_legend {
        let line = BLACK.stroke_width(2);
        chart
            .draw_series(std::iter::empty::<Circle<(u64, f64), i32>>())?
            .label("train")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], line));
        chart
            .draw_series(std::iter::empty::<Circle<(u64, f64), i32>>())?
            .label("eval")
            .legend(move |(x, y)| DashedPathElement::new(vec![(x, y), (x + 24, y)], 7, 5, line));
    }
    chart
        .configure_series_labels()
        .position(legend_corner(panel, x_hi, (y_lo, y_hi)))
        .label_font(("sans-serif", 14))
        .legend_area_size(34)
        .margin(8)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(190, 190, 190))
        .draw()?;
    Ok(())
}

/// The largest value magnitude the y axis spans. Absurd values (a loss of 1e308) made the span
/// overflow to infinity, where plotters' ticks never end: such points sit at the axis' edge.
const VALUE_LIMIT: f64 = 1e15;

/// The y axis: the values' range with a little room, not below 0 for values that are not.
fn y_range(panel: &Panel) -> (f64, f64) {
    let values = panel
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1));
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let (lo, hi) = (
        lo.clamp(-VALUE_LIMIT, VALUE_LIMIT),
        hi.clamp(-VALUE_LIMIT, VALUE_LIMIT),
    );
    let pad = if hi > lo {
        (hi - lo) * 0.06
    } else if lo == 0.0 {
        1.0
    } else {
        lo.abs() * 0.1
    };
    let bottom = if lo >= 0.0 {
        (lo - pad).max(0.0)
    } else {
        lo - pad
    };
    (bottom, hi + pad)
}

/// A step tick: `1500`, or `12.5k` on long runs.
fn format_step(step: u64, x_max: u64) -> String {
    if x_max >= 10_000 {
        format!("{}k", trim_zeros(format!("{:.1}", step as f64 / 1000.0)))
    } else {
        step.to_string()
    }
}

/// A value tick on an axis from `lo` to `hi`: decimals as fine as the ticks are (`0.25`), or
/// `5e-5` for small (learning rates) and huge values.
fn format_value(v: f64, lo: f64, hi: f64) -> String {
    let span = (hi - lo).abs().max(f64::MIN_POSITIVE);
    if v.abs() < span * 1e-9 {
        return "0".into();
    }
    let magnitude = lo.abs().max(hi.abs());
    if !(1e-2..1e5).contains(&magnitude) {
        let s = format!("{v:.3e}");
        let (mantissa, exponent) = s.split_once('e').unwrap_or((&s, "0"));
        return format!("{}e{exponent}", trim_zeros(mantissa.to_string()));
    }
    let decimals = (-(span / 10.0).log10()).ceil().clamp(0.0, 8.0) as usize;
    trim_zeros(format!("{v:.decimals$}"))
}

fn trim_zeros(s: String) -> String {
    if !s.contains('.') {
        return s;
    }
    let t = s.trim_end_matches('0').trim_end_matches('.');
    if t == "-0" {
        "0".into()
    } else {
        t.to_string()
    }
}

/// The legend's corner: the one its box would hide the fewest curve points in.
fn legend_corner(panel: &Panel, x_hi: u64, (y_lo, y_hi): (f64, f64)) -> SeriesLabelPosition {
    // The plotting area is about 490 x 290 pixels; a legend row is about 19 pixels high and a
    // label character about 8 wide, next to a 30-pixel sample.
    let mut rows = panel.series.iter().filter(|s| !s.label.is_empty()).count();
    let mut widest = panel
        .series
        .iter()
        .map(|s| s.label.chars().count())
        .max()
        .unwrap_or(0);
    if panel.style_legend {
        rows += 2;
        widest = widest.max(5);
    }
    let w = ((widest * 8 + 50) as f64 / 490.0).min(1.0);
    let h = ((rows * 19 + 20) as f64 / 290.0).min(1.0);
    let norm = |(x, y): (f64, f64)| (x / x_hi as f64, (y - y_lo) / (y_hi - y_lo));
    let mut samples = Vec::new();
    for s in &panel.series {
        let pts: Vec<(f64, f64)> = s.points.iter().map(|&(x, y)| norm((x as f64, y))).collect();
        samples.extend(&pts);
        for pair in pts.windows(2) {
            let ((x0, y0), (x1, y1)) = (pair[0], pair[1]);
            for k in 1..20 {
                let t = k as f64 / 20.0;
                samples.push((x0 + (x1 - x0) * t, y0 + (y1 - y0) * t));
            }
        }
    }
    let candidates = [
        (
            SeriesLabelPosition::UpperRight,
            (1.0 - w, 1.0),
            (1.0 - h, 1.0),
        ),
        (SeriesLabelPosition::UpperLeft, (0.0, w), (1.0 - h, 1.0)),
        (SeriesLabelPosition::LowerRight, (1.0 - w, 1.0), (0.0, h)),
        (SeriesLabelPosition::LowerLeft, (0.0, w), (0.0, h)),
        (
            SeriesLabelPosition::UpperMiddle,
            (0.5 - w / 2.0, 0.5 + w / 2.0),
            (1.0 - h, 1.0),
        ),
        (
            SeriesLabelPosition::LowerMiddle,
            (0.5 - w / 2.0, 0.5 + w / 2.0),
            (0.0, h),
        ),
    ];
    let hidden = |(x0, x1): (f64, f64), (y0, y1): (f64, f64)| {
        samples
            .iter()
            .filter(|&&(x, y)| x >= x0 && x <= x1 && y >= y0 && y <= y1)
            .count()
    };
    candidates
        .into_iter()
        .map(|(pos, xs, ys)| (hidden(xs, ys), pos))
        .min_by_key(|(n, _)| *n)
        .map(|(_, pos)| pos)
        .unwrap_or(SeriesLabelPosition::UpperRight)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Map, Value};

    /// A run of `steps` steps logging every 10 steps and evaluating every 50, as kiln's trainer
    /// does: a noisy decaying loss, a linear warmup-then-decay learning rate, rising metrics.
    pub(super) fn synthetic(name: &str, peak_lr: f64, speed: f64, steps: u64) -> RunHistory {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64 ^ (peak_lr.to_bits());
        let mut noise = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % 10_000) as f64 / 10_000.0 - 0.5
        };
        let warmup = steps / 10;
        let lr = |s: u64| {
            if s < warmup {
                peak_lr * s as f64 / warmup as f64
            } else {
                peak_lr * (steps - s) as f64 / (steps - warmup) as f64
            }
        };
        let epoch = |s: u64| (s as f64 / 100.0 * 1e4).round() / 1e4;
        let mut entries = Vec::new();
        for step in (10..=steps).step_by(10) {
            let t = step as f64 * speed;
            entries.push(json!({
                "loss": 0.35 + 0.75 * (-t / 90.0).exp() + 0.06 * noise(),
                "grad_norm": 2.0 + noise(),
                "learning_rate": lr(step),
                "step": step,
                "epoch": epoch(step),
            }));
            if step % 50 == 0 {
                let eval = 0.42 + 0.6 * (-t / 110.0).exp();
                entries.push(json!({
                    "eval_loss": eval,
                    "eval_accuracy": 0.9 - 0.5 * (-t / 100.0).exp(),
                    "eval_f1": 0.88 - 0.55 * (-t / 100.0).exp(),
                    "eval_runtime": 1.2,
                    "eval_samples_per_second": 400.0,
                    "eval_steps_per_second": 7.0,
                    "step": step,
                    "epoch": epoch(step),
                }));
            }
        }
        entries.push(json!({
            "train_runtime": 80.0, "train_loss": 0.5, "total_flos": 1e12,
            "step": steps, "epoch": epoch(steps),
        }));
        history(name, entries)
    }

    fn history(name: &str, entries: Vec<Value>) -> RunHistory {
        RunHistory {
            name: name.into(),
            dir: PathBuf::from("runs").join(name),
            entries: entries.into_iter().map(object).collect(),
        }
    }

    fn object(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn two_runs() -> Vec<RunHistory> {
        vec![
            synthetic("lr-5e-5", 5e-5, 1.0, 300),
            synthetic("lr-2e-5", 2e-5, 0.6, 300),
        ]
    }

    /// A minimal PNG reader for the tests: width, height and RGB(A) pixels of an 8-bit image.
    fn decode_png(bytes: &[u8]) -> (u32, u32, Vec<[u8; 3]>) {
        use std::io::Read;
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        let (mut pos, mut idat) = (8, Vec::new());
        let (mut width, mut height, mut channels) = (0, 0, 0);
        while pos + 8 <= bytes.len() {
            let len = u32::from_be_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
            let kind = &bytes[pos + 4..pos + 8];
            let data = &bytes[pos + 8..pos + 8 + len];
            match kind {
                b"IHDR" => {
                    width = u32::from_be_bytes(data[0..4].try_into().unwrap());
                    height = u32::from_be_bytes(data[4..8].try_into().unwrap());
                    assert_eq!(data[8], 8, "bit depth");
                    channels = match data[9] {
                        2 => 3,
                        6 => 4,
                        other => panic!("colour type {other}"),
                    };
                    assert_eq!(data[12], 0, "interlaced");
                }
                b"IDAT" => idat.extend_from_slice(data),
                _ => {}
            }
            pos += 12 + len;
        }
        let mut raw = Vec::new();
        flate2::read::ZlibDecoder::new(&idat[..])
            .read_to_end(&mut raw)
            .unwrap();
        let stride = width as usize * channels;
        assert_eq!(raw.len(), (stride + 1) * height as usize);
        let mut prev = vec![0u8; stride];
        let mut pixels = Vec::with_capacity((width * height) as usize);
        for row in raw.chunks(stride + 1) {
            let (filter, line) = (row[0], &row[1..]);
            let mut cur = vec![0u8; stride];
            for i in 0..stride {
                let a = if i >= channels { cur[i - channels] } else { 0 };
                let b = prev[i];
                let c = if i >= channels { prev[i - channels] } else { 0 };
                let predictor = match filter {
                    0 => 0,
                    1 => a,
                    2 => b,
                    3 => ((a as u16 + b as u16) / 2) as u8,
                    4 => {
                        let p = a as i16 + b as i16 - c as i16;
                        let (pa, pb, pc) = (
                            (p - a as i16).abs(),
                            (p - b as i16).abs(),
                            (p - c as i16).abs(),
                        );
                        if pa <= pb && pa <= pc {
                            a
                        } else if pb <= pc {
                            b
                        } else {
                            c
                        }
                    }
                    other => panic!("filter {other}"),
                };
                cur[i] = line[i].wrapping_add(predictor);
            }
            pixels.extend(cur.chunks(channels).map(|p| [p[0], p[1], p[2]]));
            prev = cur;
        }
        (width, height, pixels)
    }

    /// The text of the SVG's `<text>` elements.
    fn svg_texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .map(|t| {
                let body = t.split_once('>').unwrap().1;
                body.split("</text>").next().unwrap().trim().to_string()
            })
            .collect()
    }

    fn rgb(c: RGBColor) -> [u8; 3] {
        [c.0, c.1, c.2]
    }

    #[test]
    fn writes_a_png_with_every_run_drawn() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("sub/curves.png");
        plot_runs(&two_runs(), &out).unwrap();
        let (w, h, pixels) = decode_png(&std::fs::read(&out).unwrap());
        // Loss, learning rate, eval_accuracy, eval_f1: a 2 x 2 grid of 600 x 400 panels.
        assert_eq!((w, h), (1200, 800));
        let white = pixels.iter().filter(|p| **p == [255, 255, 255]).count();
        assert!(
            white < pixels.len() * 97 / 100,
            "almost blank: {white} white"
        );
        assert!(white > pixels.len() / 2, "mostly ink: {white} white");
        for color in [PALETTE[0], PALETTE[1]] {
            let n = pixels.iter().filter(|p| **p == rgb(color)).count();
            assert!(n > 1000, "{color:?}: {n} pixels");
        }
        let distinct: std::collections::HashSet<_> = pixels.iter().collect();
        assert!(distinct.len() > 50, "{} colours", distinct.len());
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(out.parent().unwrap()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn writes_an_svg_with_legend_labels_and_curves() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("curves.SVG");
        plot_runs(&two_runs(), &out).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..100]);
        assert!(svg.contains(r#"width="1200" height="800""#));
        let texts = svg_texts(&svg);
        for want in [
            "lr-5e-5 train",
            "lr-5e-5 eval",
            "lr-2e-5 train",
            "lr-2e-5 eval",
            "lr-5e-5",
            "step",
            "loss",
            "learning rate",
            "eval_accuracy",
            "eval_f1",
            "Learning rate",
            // Learning-rate ticks in scientific form; steps as integers.
            "5e-5",
            "1e-5",
            "300",
        ] {
            assert!(
                texts.iter().any(|t| t == want),
                "no text {want:?} in {texts:?}"
            );
        }
        assert!(
            !texts.iter().any(|t| t.contains("0.0000")),
            "unreadable ticks: {texts:?}"
        );
        // Per run: a train-loss and a learning-rate polyline, dashed eval pieces and markers in
        // its colour.
        for color in [PALETTE[0], PALETTE[1]] {
            let stroke = format!(
                r##"stroke="#{:02X}{:02X}{:02X}""##,
                color.0, color.1, color.2
            );
            let lines = svg
                .split('<')
                .filter(|e| e.starts_with("polyline") && e.contains(&stroke))
                .count();
            assert!(lines >= 2 + 4, "{stroke}: {lines} polylines");
        }
        // Eval markers: 6 evaluations x (loss, accuracy, f1) x 2 runs.
        assert!(svg.matches("<circle").count() >= 36);
    }

    #[test]
    fn a_single_point_run_is_drawn_as_a_marker() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("one.svg");
        let run = history(
            "one",
            vec![json!({"loss": 0.7, "learning_rate": 5e-5, "step": 10, "epoch": 0.1})],
        );
        plot_runs(&[run], &out).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        // Loss and learning rate side by side; each point a marker (and one in each legend).
        assert!(svg.contains(r#"width="1200" height="400""#));
        assert!(svg.matches("<circle").count() >= 2);
        assert!(svg_texts(&svg).iter().any(|t| t == "one"));
    }

    #[test]
    fn runs_without_train_loss_still_plot_what_they_have() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("eval.svg");
        let run = history(
            "hf",
            vec![
                json!({"eval_loss": 0.9, "eval_perplexity": 2.46, "step": 100}),
                json!({"eval_loss": 0.7, "eval_perplexity": 2.01, "step": 200}),
            ],
        );
        plot_runs(&[run], &out).unwrap();
        let svg = std::fs::read_to_string(&out).unwrap();
        let texts = svg_texts(&svg);
        assert!(texts.iter().any(|t| t == "Evaluation loss"), "{texts:?}");
        assert!(texts.iter().any(|t| t == "eval_perplexity"), "{texts:?}");
    }

    #[test]
    fn nothing_to_plot_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("none.png");
        let run = history("empty", vec![json!({"train_runtime": 3.0, "step": 5})]);
        let e = plot_runs(&[run], &out).unwrap_err().to_string();
        assert!(e.contains("nothing to plot"), "{e}");
        assert!(e.contains("runs/empty"), "{e}");
        assert!(!out.exists());
        let e = plot_runs(&[], &out).unwrap_err().to_string();
        assert!(e.contains("no runs"), "{e}");
    }

    #[test]
    fn an_unknown_extension_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("curves.jpg");
        let e = plot_runs(&two_runs(), &out).unwrap_err().to_string();
        assert!(e.contains(".jpg") && e.contains(".png or .svg"), "{e}");
        let e = plot_runs(&two_runs(), &tmp.path().join("curves"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no file extension"), "{e}");
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn absurd_values_still_draw() {
        // A span past f64's range once made the tick loop run forever.
        let run = history(
            "huge",
            vec![
                json!({"step": 1, "loss": 1e308}),
                json!({"step": 2, "loss": -1e308}),
            ],
        );
        let tmp = tempfile::tempdir().unwrap();
        plot_runs(&[run], &tmp.path().join("huge.svg")).unwrap();
        let (lo, hi) =
            y_range(&panels(&[history("h", vec![json!({"step": 1, "loss": 1e308})])]).0[0]);
        assert!(lo.is_finite() && hi.is_finite() && hi - lo < f64::INFINITY);
    }

    #[test]
    fn twenty_thousand_metrics_draw_the_first_panels_and_say_what_was_left_out() {
        let mut eval = serde_json::Map::new();
        for i in 0..20_000 {
            eval.insert(format!("eval_m{i:05}"), json!(i));
        }
        eval.insert("step".into(), json!(2));
        let run = history(
            "wide",
            vec![
                json!({"loss": 1.0, "learning_rate": 1e-4, "step": 1}),
                Value::Object(eval),
            ],
        );
        let (drawn, left_out) = panels(&[run]);
        assert_eq!(drawn.len(), MAX_PANELS);
        assert_eq!(drawn.last().unwrap().y_desc, "eval_m00061");
        assert_eq!(left_out, Some((19_938, "eval_m00062".to_string())));
        // The picture's size is checked arithmetic, and the cap keeps it drawable.
        assert_eq!(canvas(MAX_PANELS), Some(((1200, 12_800), 32, 2)));
        assert_eq!(canvas(1), Some(((600, 400), 1, 1)));
        assert_eq!(canvas(usize::MAX), None);
    }

    #[test]
    fn tick_labels_are_readable() {
        assert_eq!(format_value(5e-5, 0.0, 5.3e-5), "5e-5");
        assert_eq!(format_value(1.5000000000000002e-5, 0.0, 5.3e-5), "1.5e-5");
        assert_eq!(format_value(0.0, 0.0, 5.3e-5), "0");
        assert_eq!(format_value(0.45, 0.3, 1.2), "0.45");
        assert_eq!(format_value(0.5000000001, 0.3, 1.2), "0.5");
        assert_eq!(format_value(250.0, 10.0, 900.0), "250");
        assert_eq!(format_value(-1e-17, -0.5, 0.5), "0");
        assert_eq!(format_step(1500, 3000), "1500");
        assert_eq!(format_step(12_500, 40_000), "12.5k");
        assert_eq!(format_step(20_000, 40_000), "20k");
    }

    #[test]
    fn clashing_run_names_are_told_apart_by_path() {
        let mut a = synthetic("output", 5e-5, 1.0, 100);
        let mut b = synthetic("output", 2e-5, 1.0, 100);
        a.dir = PathBuf::from("x/output");
        b.dir = PathBuf::from("y/output");
        assert_eq!(legend_names(&[a, b]), vec!["x/output", "y/output"]);
    }

    /// Renders the synthetic runs for a person to look at:
    /// `cargo test -p kiln --lib report::plot -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn render_example() {
        let dir = std::env::temp_dir().join("plot-check");
        let mut runs = two_runs();
        let mut lm = synthetic("qwen-lm", 3e-4, 1.5, 300);
        for e in &mut lm.entries {
            if let Some(l) = e.get("eval_loss").and_then(Value::as_f64) {
                e.insert("eval_perplexity".into(), json!(l.exp()));
            }
        }
        runs.push(lm);
        plot_runs(&runs[..2], &dir.join("curves.png")).unwrap();
        plot_runs(&runs, &dir.join("curves3.png")).unwrap();
        plot_runs(&runs[..2], &dir.join("curves.svg")).unwrap();
        let many: Vec<RunHistory> = (1..=5)
            .map(|i| synthetic(&format!("seed-{i}"), 1e-5 * i as f64, 0.4 * i as f64, 2000))
            .collect();
        plot_runs(&many, &dir.join("many.png")).unwrap();
        let one = history(
            "one-step",
            vec![json!({"loss": 0.7, "learning_rate": 5e-5, "step": 1, "epoch": 0.1})],
        );
        plot_runs(&[one], &dir.join("one.png")).unwrap();
        println!("wrote {}", dir.display());
    }
}
