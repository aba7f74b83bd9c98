//! Writers for a run's report: `report.md` (markdown with tables and
//! embedded plots), CSV series and SVG line plots.
//!
//! The event loop fills a [`Report`] and calls [`write()`]. Output depends
//! only on the report's contents: identical input gives byte-identical
//! files (the plots go through plotters' SVG backend, which writes `<text>`
//! elements itself and needs no system font; floats are printed by Rust's
//! formatter, which is exact and platform independent).

use plotters::prelude::*;
use std::fmt::Write as _;
use std::io;
use std::path::Path;

/// A markdown table.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Table {
    /// Shown bold above the table (omitted when empty).
    pub title: String,
    /// Column headers.
    pub headers: Vec<String>,
    /// Rows; short rows are padded with empty cells, long ones keep their
    /// extra cells under empty headers.
    pub rows: Vec<Vec<String>>,
}

/// A line plot written as an SVG file and embedded in the report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LinePlot {
    /// Caption (also the image's alt text).
    pub title: String,
    /// X axis description.
    pub x_label: String,
    /// Y axis description.
    pub y_label: String,
    /// Named series of `(x, y)` points, drawn in order; non-finite points
    /// are skipped.
    pub series: Vec<(String, Vec<(f64, f64)>)>,
    /// File name relative to the report directory, e.g.
    /// `admitted-vs-bound.svg`.
    pub file: String,
    /// X ranges shaded behind the series (the scenario's faults: cuts,
    /// crashes, storms, suspends, shutdowns, rule changes).
    pub spans: Vec<(f64, f64)>,
}

/// A section of the report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Section {
    /// Heading.
    pub title: String,
    /// Markdown paragraphs, written before the tables.
    pub paragraphs: Vec<String>,
    /// Tables.
    pub tables: Vec<Table>,
    /// Plots (each written to its file and embedded).
    pub plots: Vec<LinePlot>,
    /// CSV files: `(file, header, rows)`, written and linked.
    pub csv: Vec<(String, Vec<String>, Vec<Vec<String>>)>,
}

/// A whole report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// Top heading.
    pub title: String,
    /// Markdown paragraphs under the title.
    pub preamble: Vec<String>,
    /// Sections in order.
    pub sections: Vec<Section>,
}

/// Plot size in pixels.
const PLOT_SIZE: (u32, u32) = (900, 480);

/// Writes `report.md`, every CSV and every SVG of `report` into `dir`
/// (created if missing). File names must be relative and stay inside
/// `dir`.
pub fn write(report: &Report, dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for s in &report.sections {
        for p in &s.plots {
            write_file(dir, &p.file, svg(p)?.as_bytes())?;
        }
        for (file, header, rows) in &s.csv {
            write_file(dir, file, csv(header, rows).as_bytes())?;
        }
    }
    write_file(dir, "report.md", markdown(report).as_bytes())
}

fn write_file(dir: &Path, file: &str, bytes: &[u8]) -> io::Result<()> {
    let rel = Path::new(file);
    let safe = !file.is_empty()
        && rel
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
    if !safe {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "report file name {file:?} must be a relative path inside the report directory"
            ),
        ));
    }
    let path = dir.join(rel);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, bytes)
}

/// The markdown text of `report.md`.
pub fn markdown(report: &Report) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# {}\n", one_line(&report.title));
    for p in &report.preamble {
        let _ = writeln!(md, "{}\n", p.trim_end());
    }
    for s in &report.sections {
        let _ = writeln!(md, "## {}\n", one_line(&s.title));
        for p in &s.paragraphs {
            let _ = writeln!(md, "{}\n", p.trim_end());
        }
        for t in &s.tables {
            md.push_str(&table(t));
            md.push('\n');
        }
        for p in &s.plots {
            let _ = writeln!(md, "![{}]({})\n", alt(&p.title), p.file);
        }
        if !s.csv.is_empty() {
            let links: Vec<String> = s
                .csv
                .iter()
                .map(|(f, _, rows)| format!("[{f}]({f}) ({} rows)", rows.len()))
                .collect();
            let _ = writeln!(md, "Data: {}\n", links.join(", "));
        }
    }
    // Exactly one newline at the end.
    while md.ends_with("\n\n") {
        md.pop();
    }
    md
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn alt(s: &str) -> String {
    one_line(s).replace(['[', ']'], "")
}

fn cell(s: &str) -> String {
    one_line(s).replace('|', "\\|")
}

/// A markdown table (with its bold title line if any).
fn table(t: &Table) -> String {
    let mut out = String::new();
    if !t.title.is_empty() {
        let _ = writeln!(out, "**{}**\n", one_line(&t.title));
    }
    let cols = t
        .rows
        .iter()
        .map(Vec::len)
        .chain(std::iter::once(t.headers.len()))
        .max()
        .unwrap_or(0)
        .max(1);
    let row = |cells: &[String]| {
        let mut line = String::from("|");
        for i in 0..cols {
            let c = cells.get(i).map_or(String::new(), |c| cell(c));
            let _ = write!(line, " {c} |");
        }
        line.push('\n');
        line
    };
    out.push_str(&row(&t.headers));
    out.push('|');
    for _ in 0..cols {
        out.push_str(" --- |");
    }
    out.push('\n');
    for r in &t.rows {
        out.push_str(&row(r));
    }
    out
}

/// CSV text (RFC 4180 quoting: fields with a comma, quote or line break
/// are quoted, quotes doubled; `\n` line ends).
pub fn csv(header: &[String], rows: &[Vec<String>]) -> String {
    let mut out = String::new();
    let mut line = |cells: &[String]| {
        let fields: Vec<String> = cells
            .iter()
            .map(|c| {
                if c.contains([',', '"', '\n', '\r']) {
                    format!("\"{}\"", c.replace('"', "\"\""))
                } else {
                    c.clone()
                }
            })
            .collect();
        out.push_str(&fields.join(","));
        out.push('\n');
    };
    line(header);
    for r in rows {
        line(r);
    }
    out
}

/// Axis range covering the finite values, padded; never empty.
fn range(values: impl Iterator<Item = f64>, pad_frac: f64) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if lo > hi {
        return (0.0, 1.0);
    }
    if lo == hi {
        let d = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        return (lo - d, hi + d);
    }
    let pad = (hi - lo) * pad_frac;
    (lo - pad, hi + pad)
}

/// Colors of the series, in order (then repeated).
const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// A tick label: at most three decimals, trailing zeros dropped.
fn tick(v: &f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

/// The SVG text of a plot.
pub fn svg(p: &LinePlot) -> io::Result<String> {
    let mut out = String::new();
    draw(p, &mut out).map_err(|e| io::Error::other(format!("plot {}: {e}", p.file)))?;
    Ok(out)
}

fn draw(p: &LinePlot, out: &mut String) -> Result<(), Box<dyn std::error::Error>> {
    let finite = |&(x, y): &(f64, f64)| x.is_finite() && y.is_finite();
    let pts = || {
        p.series
            .iter()
            .flat_map(|(_, s)| s.iter().filter(|q| finite(q)))
    };
    let (x0, x1) = range(pts().map(|q| q.0), 0.0);
    let (y0, y1) = range(pts().map(|q| q.1), 0.05);
    {
        let root = SVGBackend::with_string(out, PLOT_SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(one_line(&p.title), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(72)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .x_desc(one_line(&p.x_label))
            .y_desc(one_line(&p.y_label))
            .light_line_style(WHITE.mix(0.0))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 15))
            .x_label_formatter(&tick)
            .y_label_formatter(&tick)
            .draw()?;
        for &(a, b) in &p.spans {
            let (a, b) = (a.max(x0), b.min(x1));
            if a < b {
                chart.draw_series(std::iter::once(Rectangle::new(
                    [(a, y0), (b, y1)],
                    RGBColor(160, 160, 160).mix(0.25).filled(),
                )))?;
            }
        }
        for (i, (name, series)) in p.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(
                    series.iter().copied().filter(finite),
                    color.stroke_width(2),
                ))?
                .label(one_line(name))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        if p.series.iter().any(|(n, _)| !n.is_empty()) {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 14))
                .draw()?;
        }
        root.present()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        Report {
            title: "hot-tenant (seed 1)".into(),
            preamble: vec!["One hot tenant at 3x its rate.".into()],
            sections: vec![Section {
                title: "Rule hot".into(),
                paragraphs: vec!["I1 held: worst excess -12 tokens.".into()],
                tables: vec![Table {
                    title: "Per rule".into(),
                    headers: vec!["rule".into(), "admitted".into(), "bound".into()],
                    rows: vec![
                        vec!["hot".into(), "600000".into(), "602000".into()],
                        vec!["a|b".into(), "1".into()],
                    ],
                }],
                plots: vec![LinePlot {
                    title: "Admitted vs bound".into(),
                    x_label: "time (s)".into(),
                    y_label: "tokens".into(),
                    series: vec![
                        (
                            "admitted".into(),
                            (0..60)
                                .map(|i| (f64::from(i), f64::from(i) * 9_990.0))
                                .collect(),
                        ),
                        (
                            "B + R*T".into(),
                            (0..60)
                                .map(|i| (f64::from(i), 2_000.0 + f64::from(i) * 10_000.0))
                                .collect(),
                        ),
                        ("empty".into(), vec![(f64::NAN, 1.0)]),
                    ],
                    file: "admitted-vs-bound.svg".into(),
                    spans: vec![(10.0, 20.0), (55.0, 99.0)],
                }],
                csv: vec![(
                    "series.csv".into(),
                    vec!["t_s".into(), "admitted".into()],
                    vec![
                        vec!["0".into(), "1".into()],
                        vec!["1".into(), "x,\"y\"".into()],
                    ],
                )],
            }],
        }
    }

    fn tmp(name: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("quotalease-report-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn writes_markdown_csv_and_svg() {
        let d = tmp("a");
        write(&sample(), &d).unwrap();
        let md = std::fs::read_to_string(d.join("report.md")).unwrap();
        assert!(md.starts_with("# hot-tenant (seed 1)\n\nOne hot tenant"));
        assert!(md.contains("| rule | admitted | bound |\n| --- | --- | --- |\n"));
        assert!(md.contains("| a\\|b | 1 |  |\n"));
        assert!(md.contains("![Admitted vs bound](admitted-vs-bound.svg)"));
        assert!(md.contains("[series.csv](series.csv) (2 rows)"));
        assert!(md.ends_with("rows)\n"));
        let csv = std::fs::read_to_string(d.join("series.csv")).unwrap();
        assert_eq!(csv, "t_s,admitted\n0,1\n1,\"x,\"\"y\"\"\"\n");
        let svg = std::fs::read_to_string(d.join("admitted-vs-bound.svg")).unwrap();
        assert!(svg.starts_with("<svg"));
        // Text is written as SVG <text> elements, no font files involved.
        for t in [
            "Admitted vs bound",
            "time (s)",
            "tokens",
            "B + R*T",
            "admitted",
        ] {
            assert!(svg.contains(&format!(">{t}<")) || svg.contains(t), "{t}");
        }
        assert!(svg.contains("<text"));
        assert!(svg.contains("<polyline"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn output_is_byte_identical() {
        let (a, b) = (tmp("b1"), tmp("b2"));
        write(&sample(), &a).unwrap();
        write(&sample(), &b).unwrap();
        for f in ["report.md", "series.csv", "admitted-vs-bound.svg"] {
            assert_eq!(
                std::fs::read(a.join(f)).unwrap(),
                std::fs::read(b.join(f)).unwrap(),
                "{f}"
            );
        }
        let _ = std::fs::remove_dir_all(&a);
        let _ = std::fs::remove_dir_all(&b);
    }

    #[test]
    fn fault_spans_are_shaded_within_the_plot() {
        let mut p = sample().sections[0].plots[0].clone();
        let shaded = svg(&p).unwrap().matches("<rect").count();
        p.spans.clear();
        let plain = svg(&p).unwrap().matches("<rect").count();
        // Two spans, the second clipped to the x range (0..59).
        assert_eq!(shaded, plain + 2);
        p.spans = vec![(70.0, 80.0)];
        assert_eq!(
            svg(&p).unwrap().matches("<rect").count(),
            plain,
            "outside: none"
        );
    }

    #[test]
    fn degenerate_plots_and_bad_names() {
        let mut p = LinePlot {
            file: "x.svg".into(),
            ..LinePlot::default()
        };
        assert!(svg(&p).unwrap().contains("<svg"));
        p.series = vec![("flat".into(), vec![(1.0, 5.0), (1.0, 5.0)])];
        assert!(svg(&p).unwrap().contains("<svg"));
        let d = tmp("c");
        for bad in ["../x.svg", "/tmp/x.svg", ""] {
            let r = Report {
                sections: vec![Section {
                    plots: vec![LinePlot {
                        file: bad.into(),
                        ..p.clone()
                    }],
                    ..Section::default()
                }],
                ..Report::default()
            };
            assert!(write(&r, &d).is_err(), "{bad}");
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}
