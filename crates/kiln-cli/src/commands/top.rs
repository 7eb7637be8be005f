//! `kiln top`: a live view of running training jobs, one row per rank, from the state each rank
//! publishes in its output folder (`kiln::report::live`).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Gauge, Paragraph, Row, Sparkline, Table, TableState};
use ratatui::Frame;
use serde::Serialize;

use kiln::report::escape_for_terminal;
use kiln::report::live::{self, RankView};

#[derive(Args)]
pub struct TopCmd {
    /// Output folders of training jobs (default: every kiln job running on this machine). Ranks
    /// on other machines appear when the folder is shared with them.
    run_dirs: Vec<PathBuf>,
    /// Print one snapshot and exit: a table, or JSON with --json.
    #[arg(long)]
    once: bool,
    /// With --once: `{"ranks": [{"rank": 0, "step": …, "loss": …, …}, …]}`.
    #[arg(long, requires = "once")]
    json: bool,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0, value_parser = positive_seconds)]
    interval: f64,
}

fn positive_seconds(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err("must be a number of seconds above 0".into()),
    }
}

/// One job: its output folder and its ranks as they look now.
#[derive(Debug, Clone, Serialize)]
pub struct JobView {
    pub output_dir: PathBuf,
    pub ranks: Vec<RankView>,
    /// Files in its live/ folder that were not read as a rank, one line each (escaped).
    #[serde(skip)]
    pub skipped: Vec<String>,
}

/// What to watch: the folders given, or the jobs registered on this machine (an error when the
/// runtime folder is not this user's own: nothing in it is read or deleted then).
fn job_dirs(given: &[PathBuf]) -> Result<Vec<PathBuf>> {
    if given.is_empty() {
        Ok(live::running_jobs(&live::runtime_dir())?)
    } else {
        Ok(given.to_vec())
    }
}

/// Reads every job's ranks now; a folder without live state is an error only when it was named.
fn snapshot(given: &[PathBuf]) -> Result<Vec<JobView>> {
    let now = live::unix_now();
    let host = live::hostname();
    let mut jobs = Vec::new();
    for dir in job_dirs(given)? {
        let found = match live::read_live(&dir) {
            Ok(r) => r,
            Err(e) if !given.is_empty() => return Err(e.into()),
            Err(_) => continue,
        };
        let ranks = found
            .ranks
            .into_iter()
            .map(|s| RankView::new(s, now, &host))
            .collect();
        jobs.push(JobView {
            output_dir: dir,
            ranks,
            skipped: found.skipped,
        });
    }
    Ok(jobs)
}

pub fn run(cmd: TopCmd) -> Result<()> {
    if cmd.once {
        let jobs = snapshot(&cmd.run_dirs)?;
        if jobs.is_empty() {
            bail!(
                "no kiln training job is running on this machine (name its output folder: kiln \
                 top OUTPUT_DIR)"
            );
        }
        // A FIFO, a device or a torn file among the rank files: one line each, then the rest.
        for line in jobs.iter().flat_map(|j| &j.skipped) {
            eprintln!("kiln top: {line}");
        }
        if cmd.json {
            let ranks: Vec<&RankView> = jobs.iter().flat_map(|j| &j.ranks).collect();
            println!(
                "{}",
                json_for_terminal(&serde_json::json!({ "ranks": ranks }))
            );
        } else {
            print!("{}", plain_table(&jobs));
        }
        return Ok(());
    }
    if !std::io::stdout().is_terminal() {
        bail!("kiln top draws on a terminal; for scripts use kiln top --once (--json)");
    }
    // Named folders must exist now; live state may come later (a job still loading).
    for d in &cmd.run_dirs {
        if !d.is_dir() {
            bail!(
                "{} is not a folder (give a training job's output folder)",
                d.display()
            );
        }
    }
    let mut terminal = ratatui::init();
    let out = watch(&mut terminal, &cmd);
    ratatui::restore();
    out
}

/// The screen's state between refreshes.
#[derive(Default)]
pub struct App {
    pub jobs: Vec<JobView>,
    pub job: usize,
    pub rank: usize,
    pub error: Option<String>,
}

impl App {
    fn refresh(&mut self, given: &[PathBuf]) {
        match snapshot(given) {
            Ok(jobs) => {
                self.jobs = jobs;
                self.error = None;
            }
            Err(e) => self.error = Some(e.to_string()),
        }
        self.job = self.job.min(self.jobs.len().saturating_sub(1));
        let n = self.jobs.get(self.job).map_or(0, |j| j.ranks.len());
        self.rank = self.rank.min(n.saturating_sub(1));
    }
}

fn watch(terminal: &mut ratatui::DefaultTerminal, cmd: &TopCmd) -> Result<()> {
    let interval = Duration::from_secs_f64(cmd.interval);
    let mut app = App::default();
    app.refresh(&cmd.run_dirs);
    let mut last = Instant::now();
    loop {
        terminal.draw(|f| render(f, &app))?;
        let wait = interval.saturating_sub(last.elapsed());
        if event::poll(wait)? {
            if let Event::Key(k) = event::read()? {
                if k.kind != KeyEventKind::Press {
                    continue;
                }
                match k.code {
                    KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                    KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                        return Ok(())
                    }
                    KeyCode::Up => app.rank = app.rank.saturating_sub(1),
                    KeyCode::Down => app.rank += 1,
                    KeyCode::Left => (app.job, app.rank) = (app.job.saturating_sub(1), 0),
                    KeyCode::Right => (app.job, app.rank) = (app.job + 1, 0),
                    _ => {}
                }
                // Clamp the selection.
                app.refresh_selection();
            }
        }
        if last.elapsed() >= interval {
            app.refresh(&cmd.run_dirs);
            last = Instant::now();
        }
    }
}

impl App {
    fn refresh_selection(&mut self) {
        self.job = self.job.min(self.jobs.len().saturating_sub(1));
        let n = self.jobs.get(self.job).map_or(0, |j| j.ranks.len());
        self.rank = self.rank.min(n.saturating_sub(1));
    }
}

const HEADERS: [&str; 15] = [
    "rank",
    "host",
    "status",
    "step",
    "loss",
    "lr",
    "grad norm",
    "samples/s",
    "tokens/s",
    "ETA",
    "CPU %",
    "RSS",
    "comm %",
    "GPU %",
    "GPU mem",
];

/// The cells of one rank's row.
fn cells(r: &RankView) -> [String; 15] {
    let s = &r.state;
    let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or("-".into(), f);
    let busy = s.compute_seconds + s.collective_seconds;
    let status = if r.is_unhealthy() && r.status != "failed" {
        // Say how long it has been silent (or without a step).
        let secs = if r.status == "stalled" {
            r.since_step_seconds
        } else {
            r.last_seen_seconds
        };
        format!("{} {}", r.status, duration(secs))
    } else {
        r.status.clone()
    };
    [
        s.rank.to_string(),
        // From a file anyone may have written: its control characters must not reach the screen.
        escape_for_terminal(&s.host),
        status,
        format!("{}/{}", s.step, s.total_steps),
        opt(s.loss, &|v| format!("{v:.4}")),
        opt(s.learning_rate, &|v| format!("{v:.2e}")),
        opt(s.grad_norm, &|v| format!("{v:.3}")),
        format!("{:.1}", s.samples_per_second),
        format!("{:.0}", s.tokens_per_second),
        opt(s.eta_seconds, &duration),
        format!("{:.0}", s.cpu_percent),
        bytes(s.rss_bytes),
        if busy > 0.0 {
            format!("{:.0}", 100.0 * s.collective_seconds / busy)
        } else {
            "-".into()
        },
        s.gpu
            .map_or("-".into(), |g| g.utilization_percent.to_string()),
        s.gpu.map_or("-".into(), |g| {
            format!(
                "{}/{}",
                bytes(g.memory_used_bytes),
                bytes(g.memory_total_bytes)
            )
        }),
    ]
}

/// A folder's path for the screen: it comes from a job entry or a folder name, which may hold
/// escape sequences.
fn shown_path(p: &std::path::Path) -> String {
    escape_for_terminal(&p.display().to_string())
}

/// `value` as JSON whose text cannot drive a terminal either: serde_json escapes the ASCII control
/// characters, and this the others (C1 controls such as U+009B, a CSI on some terminals) and the
/// bidirectional overrides, as `\uXXXX` escapes that decode to the same strings.
fn json_for_terminal(value: &serde_json::Value) -> String {
    let text = value.to_string();
    let unsafe_char = |c: char| {
        let one = c.to_string();
        escape_for_terminal(&one) != one
    };
    if !text.chars().any(|c| !c.is_ascii() && unsafe_char(c)) {
        return text;
    }
    text.chars()
        .map(|c| {
            if !c.is_ascii() && unsafe_char(c) {
                // Every such character is in the Basic Multilingual Plane: one \u escape.
                format!("\\u{:04x}", c as u32)
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// `1h02m`, `3m05s`, `42s`.
fn duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

fn bytes(b: u64) -> String {
    let g = b as f64 / (1u64 << 30) as f64;
    if g >= 1.0 {
        format!("{g:.1}G")
    } else {
        format!("{:.0}M", b as f64 / (1u64 << 20) as f64)
    }
}

/// `--once` without `--json`: the same rows as the screen, as plain text.
fn plain_table(jobs: &[JobView]) -> String {
    let mut out = String::new();
    for j in jobs {
        out.push_str(&format!("{}\n", shown_path(&j.output_dir)));
        let rows: Vec<[String; 15]> = j.ranks.iter().map(cells).collect();
        let width = |c: usize| {
            rows.iter()
                .map(|r| r[c].chars().count())
                .chain([HEADERS[c].len()])
                .max()
                .unwrap_or(0)
        };
        let widths: Vec<usize> = (0..HEADERS.len()).map(width).collect();
        let line = |cols: Vec<&str>| {
            let mut l = cols
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect::<Vec<_>>()
                .join("  ");
            l.truncate(l.trim_end().len());
            l + "\n"
        };
        out.push_str(&line(HEADERS.to_vec()));
        for r in &rows {
            out.push_str(&line(r.iter().map(String::as_str).collect()));
        }
    }
    out
}

/// Draws the whole screen.
pub fn render(f: &mut Frame, app: &App) {
    let [title, head, table, spark, foot] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(3),
        Constraint::Min(4),
        Constraint::Length(8),
        Constraint::Length(1),
    ])
    .areas(f.area());
    f.render_widget(
        Paragraph::new(Line::from(vec![
            Span::styled(" kiln top ", Style::new().add_modifier(Modifier::REVERSED)),
            Span::raw(format!(
                "  {} job(s) · q quit · ↑↓ rank · ←→ job",
                app.jobs.len()
            )),
        ])),
        title,
    );
    let skipped = app.jobs.get(app.job).and_then(|j| j.skipped.first());
    if let Some(e) = app.error.as_ref().or(skipped) {
        f.render_widget(
            Paragraph::new(escape_for_terminal(e)).style(Style::new().fg(Color::Red)),
            foot,
        );
    }
    let Some(job) = app.jobs.get(app.job) else {
        f.render_widget(
            Paragraph::new("waiting for a kiln training job (its ranks publish live/rank-N.json)")
                .block(Block::bordered()),
            head,
        );
        return;
    };
    render_header(f, head, job);
    render_table(f, table, job, app.rank);
    if let Some(r) = job.ranks.get(app.rank) {
        render_sparkline(f, spark, r);
    }
}

fn render_header(f: &mut Frame, area: ratatui::layout::Rect, job: &JobView) {
    let lead = job.ranks.iter().max_by_key(|r| r.state.step);
    let (step, total) = lead.map_or((0, 0), |r| (r.state.step, r.state.total_steps));
    let samples: f64 = job.ranks.iter().map(|r| r.state.samples_per_second).sum();
    let tokens: f64 = job.ranks.iter().map(|r| r.state.tokens_per_second).sum();
    let unhealthy = job.ranks.iter().filter(|r| r.is_unhealthy()).count();
    let label = format!(
        "step {step}/{total} · {} rank(s){} · {samples:.1} samples/s · {tokens:.0} tokens/s",
        job.ranks.len(),
        if unhealthy > 0 {
            format!(" ({unhealthy} not running)")
        } else {
            String::new()
        },
    );
    let ratio = if total > 0 {
        (step as f64 / total as f64).clamp(0.0, 1.0)
    } else {
        0.0
    };
    f.render_widget(
        Gauge::default()
            .block(Block::bordered().title(format!(" {} ", shown_path(&job.output_dir))))
            .gauge_style(Style::new().fg(Color::Green))
            .ratio(ratio)
            .label(label),
        area,
    );
}

fn render_table(f: &mut Frame, area: ratatui::layout::Rect, job: &JobView, selected: usize) {
    let rows: Vec<Row> = job
        .ranks
        .iter()
        .map(|r| {
            let c = cells(r);
            let style = if r.is_unhealthy() {
                Style::new().fg(Color::Red)
            } else {
                Style::new()
            };
            Row::new(c.into_iter().map(Cell::from)).style(style)
        })
        .collect();
    let widths = [4, 10, 13, 11, 8, 9, 9, 9, 9, 7, 6, 7, 6, 5, 11].map(Constraint::Length);
    let table = Table::new(rows, widths)
        .header(Row::new(HEADERS).style(Style::new().add_modifier(Modifier::BOLD)))
        .block(Block::new().borders(Borders::ALL).title(" ranks "))
        .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED));
    let mut state = TableState::default().with_selected(Some(selected));
    f.render_stateful_widget(table, area, &mut state);
}

fn render_sparkline(f: &mut Frame, area: ratatui::layout::Rect, r: &RankView) {
    let h = &r.state.loss_history;
    let (lo, hi) = h
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    // Bars from the lowest loss (a sliver, still visible) to the highest (100 units); the newest
    // on the right.
    let width = area.width.saturating_sub(2) as usize;
    let data: Vec<u64> = h[h.len().saturating_sub(width)..]
        .iter()
        .map(|&v| {
            if hi > lo {
                12 + (88.0 * (v - lo) / (hi - lo)) as u64
            } else {
                50
            }
        })
        .collect();
    let title = if h.is_empty() {
        format!(" loss, rank {}: no step yet ", r.state.rank)
    } else {
        format!(
            " loss, rank {}: last {} steps, {lo:.4} – {hi:.4} ",
            r.state.rank,
            data.len()
        )
    };
    f.render_widget(
        Sparkline::default()
            .block(Block::bordered().title(title))
            .data(&data)
            .max(100)
            .style(Style::new().fg(Color::Cyan)),
        area,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln::report::live::{Phase, RankState};
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    fn rank(rank: usize, step: u64, heartbeat_age: f64) -> RankView {
        let now = 10_000.0;
        let s = RankState {
            rank,
            world_size: 2,
            pid: std::process::id(),
            host: "node-a".into(),
            phase: Phase::Training,
            step,
            total_steps: 200,
            loss: Some(0.5),
            learning_rate: Some(3e-5),
            grad_norm: Some(1.25),
            samples_per_second: 12.5,
            tokens_per_second: 1600.0,
            step_seconds: 0.64,
            eta_seconds: Some(125.0),
            compute_seconds: 30.0,
            collective_seconds: 10.0,
            cpu_percent: 97.0,
            rss_bytes: 900 << 20,
            loss_history: (0..50).map(|i| 1.0 / (1.0 + i as f64)).collect(),
            heartbeat_unix: now - heartbeat_age,
            last_step_unix: now - 0.5,
            ..RankState::default()
        };
        RankView::new(s, now, "node-b")
    }

    fn screen(app: &App) -> String {
        let mut t = Terminal::new(TestBackend::new(150, 24)).unwrap();
        t.draw(|f| render(f, app)).unwrap();
        let buf = t.backend().buffer().clone();
        (0..buf.area.height)
            .map(|y| {
                (0..buf.area.width)
                    .map(|x| buf[(x, y)].symbol().to_string())
                    .collect::<String>()
                    + "\n"
            })
            .collect()
    }

    #[test]
    fn the_screen_shows_every_rank_and_a_lost_one_as_such() {
        let app = App {
            jobs: vec![JobView {
                output_dir: "/runs/minilm".into(),
                ranks: vec![rank(0, 120, 0.3), rank(1, 118, 42.0)],
                skipped: Vec::new(),
            }],
            ..App::default()
        };
        let s = screen(&app);
        eprintln!("{s}");
        assert!(s.contains("/runs/minilm"), "{s}");
        assert!(s.contains("step 120/200"), "the job's progress: {s}");
        assert!(
            s.contains("25.0 samples/s"),
            "the job's throughput sums the ranks: {s}"
        );
        assert!(s.contains("120/200") && s.contains("118/200"), "{s}");
        // Rank 0 trains; rank 1 has been silent for 42 s (on another host: lost, not exited).
        let row = |r: &str| {
            let start = format!("│{r} ");
            s.lines()
                .find(|l| l.starts_with(&start))
                .unwrap()
                .to_string()
        };
        assert!(
            row("0").contains("120/200") && row("0").contains("training"),
            "{s}"
        );
        assert!(
            row("1").contains("118/200") && row("1").contains("lost 42s"),
            "{s}"
        );
        assert!(s.contains("(1 not running)"), "{s}");
        // comm % = 10 / (30 + 10); ETA 125 s; RSS 900 MiB.
        assert!(row("0").contains(" 25 "), "{s}");
        assert!(row("0").contains("2m05s") && row("0").contains("900M"));
        assert!(
            s.contains("loss, rank 0: last 50 steps, 0.0200 – 1.0000"),
            "{s}"
        );
        // The sparkline draws bars.
        assert!(s.contains('█'), "{s}");
    }

    #[test]
    fn plain_table_lines_up_with_the_screen() {
        let jobs = vec![JobView {
            output_dir: "/runs/x".into(),
            ranks: vec![rank(0, 5, 0.1)],
            skipped: Vec::new(),
        }];
        let t = plain_table(&jobs);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "/runs/x");
        assert!(lines[1].starts_with("rank  host"), "{t}");
        assert!(lines[2].starts_with("0     node-a  training"), "{t}");
        assert!(!t.contains('\x1b'), "plain text");
    }

    #[test]
    fn text_from_files_is_escaped_on_the_screen_and_in_the_table() {
        let mut r = rank(0, 5, 0.1);
        r.state.host = "evil\x1b]0;pwned\x07\x1b[2J".into();
        let app = App {
            jobs: vec![JobView {
                output_dir: "/runs/\x1b[31mred".into(),
                ranks: vec![r],
                skipped: vec!["skipped /runs/x/live/rank-1.json: a FIFO".into()],
            }],
            ..App::default()
        };
        let text = plain_table(&app.jobs) + &screen(&app);
        assert!(!text.contains(['\x1b', '\x07']), "{text:?}");
        assert!(text.contains("evil\\u{1b}]0;pwned"), "{text}");
        assert!(text.contains("a FIFO"), "the skipped file is said: {text}");
    }

    #[test]
    fn json_output_escapes_what_serde_json_leaves_raw() {
        let v = serde_json::json!({"host": "a\u{202e}b\u{9b}2Jc\x1bé"});
        let text = json_for_terminal(&v);
        assert!(!text.contains(['\u{202e}', '\u{9b}', '\x1b']), "{text}");
        assert!(text.contains('é'), "other text is kept: {text}");
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, v, "the same strings");
    }

    #[test]
    fn durations_and_sizes_read_well() {
        assert_eq!(duration(42.4), "42s");
        assert_eq!(duration(185.0), "3m05s");
        assert_eq!(duration(3720.0), "1h02m");
        assert_eq!(bytes(3 << 29), "1.5G");
        assert_eq!(bytes(200 << 20), "200M");
    }
}
