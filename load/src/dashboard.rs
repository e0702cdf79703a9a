//! A picture of a Grafana dashboard drawn from live data: every panel's queries asked of a
//! Prometheus server over a time range (`/api/v1/query_range`), each panel drawn where the
//! dashboard's grid puts it, as an SVG. For the README's pictures, which must show what the
//! dashboards show on real series, where no Grafana can be installed. Only what Ferry's
//! dashboards use is drawn: rows and time-series panels, legends from `legendFormat`, the units
//! `reqps`, `s`, `percentunit` and `short`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, Context};
use plotters::prelude::*;
use serde_json::Value;

/// One line of a panel: its legend and its points (seconds before the end, value).
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub legend: String,
    pub points: Vec<(f64, f64)>,
}

/// A panel to draw: where (in grid units: 24 across), what, and its lines.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    pub title: String,
    pub kind: String,
    pub unit: String,
    pub grid: (u32, u32, u32, u32),
    pub queries: Vec<(String, String)>,
    pub lines: Vec<Line>,
}

/// `legendFormat` with each `{{label}}` replaced by the series' label (empty when absent).
pub fn legend(format: &str, labels: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = format;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let Some(end) = rest[start..].find("}}") else { break };
        let name = rest[start + 2..start + end].trim();
        out.push_str(labels.get(name).map_or("", String::as_str));
        rest = &rest[start + end + 2..];
    }
    out.push_str(rest);
    out
}

/// The expression as Grafana sends it: `$__rate_interval` as given, every other variable at
/// `vars`' value or "All" (`.*`).
pub fn substitute(expr: &str, rate_interval: &str, vars: &BTreeMap<String, String>) -> String {
    let expr = expr.replace("$__rate_interval", rate_interval);
    let mut out = String::new();
    let mut chars = expr.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c != '$' {
            out.push(c);
            continue;
        }
        let braced = expr[i + 1..].starts_with('{');
        let from = i + 1 + usize::from(braced);
        let len = expr[from..].find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(expr.len() - from);
        let name = &expr[from..from + len];
        out.push_str(vars.get(name).map_or(".*", String::as_str));
        let skip = len + 2 * usize::from(braced);
        for _ in 0..skip {
            chars.next();
        }
    }
    out
}

/// The panels of a dashboard's JSON, without their lines.
pub fn panels(board: &Value) -> anyhow::Result<Vec<Panel>> {
    let list = board["panels"].as_array().ok_or_else(|| anyhow!("the dashboard has no panels"))?;
    list.iter()
        .map(|p| {
            let g = &p["gridPos"];
            let n = |k: &str| g[k].as_u64().map(|v| v as u32).ok_or_else(|| anyhow!("gridPos.{k} missing"));
            let queries = p["targets"]
                .as_array()
                .map(|ts| {
                    ts.iter()
                        .map(|t| {
                            (
                                t["expr"].as_str().unwrap_or("").to_owned(),
                                t["legendFormat"].as_str().unwrap_or("").to_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            Ok(Panel {
                title: p["title"].as_str().unwrap_or("").to_owned(),
                kind: p["type"].as_str().unwrap_or("").to_owned(),
                unit: p["fieldConfig"]["defaults"]["unit"].as_str().unwrap_or("short").to_owned(),
                grid: (n("x")?, n("y")?, n("w")?, n("h")?),
                queries,
                lines: Vec::new(),
            })
        })
        .collect()
}

/// The lines of one `query_range` answer, times made relative to `end` (seconds, negative).
pub fn lines(answer: &Value, legend_format: &str, end: f64) -> anyhow::Result<Vec<Line>> {
    if answer["status"] != "success" {
        return Err(anyhow!("Prometheus answered {answer}"));
    }
    let result = answer["data"]["result"].as_array().ok_or_else(|| anyhow!("no result in {answer}"))?;
    Ok(result
        .iter()
        .map(|series| {
            let labels: BTreeMap<String, String> = series["metric"]
                .as_object()
                .map(|m| m.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_owned())).collect())
                .unwrap_or_default();
            let points = series["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|pair| {
                    let t = pair[0].as_f64()?;
                    let v: f64 = pair[1].as_str()?.parse().ok()?;
                    v.is_finite().then_some((t - end, v))
                })
                .collect();
            Line { legend: legend(legend_format, &labels), points }
        })
        .collect())
}

/// Asks Prometheus for every panel's lines over the `range` before now.
pub async fn fetch(
    prometheus: &str,
    mut panels: Vec<Panel>,
    range: Duration,
    rate_interval: &str,
    vars: &BTreeMap<String, String>,
) -> anyhow::Result<Vec<Panel>> {
    let client = reqwest::Client::new();
    // Now itself, not the whole second before it: a series whose second sample arrived in the
    // last fraction of a second has a rate now and none at the second before.
    let end = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs_f64();
    let start = end - range.as_secs_f64();
    let step = (range.as_secs_f64() / 120.0).max(1.0);
    for panel in &mut panels {
        for (expr, format) in &panel.queries {
            let query = substitute(expr, rate_interval, vars);
            let answer: Value = client
                .get(format!("{}/api/v1/query_range", prometheus.trim_end_matches('/')))
                .query(&[
                    ("query", query.as_str()),
                    ("start", &start.to_string()),
                    ("end", &end.to_string()),
                    ("step", &step.to_string()),
                ])
                .send()
                .await
                .with_context(|| format!("asking {prometheus} for {query}"))?
                .json()
                .await?;
            panel.lines.extend(lines(&answer, format, end).with_context(|| format!("panel {}", panel.title))?);
        }
    }
    Ok(panels)
}

/// Pixels per grid column, and per grid row.
const COLUMN: u32 = 60;
const ROW: u32 = 34;

const COLOURS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// The factor and suffix that put a panel's values, the largest of them `top`, in its unit on
/// the axis: seconds as milliseconds below one second, as seconds from there (never "60kms").
fn scale(unit: &str, top: f64) -> (f64, &'static str) {
    match unit {
        "percentunit" => (100.0, "%"),
        "s" if top < 1.0 => (1000.0, "ms"),
        "s" => (1.0, "s"),
        "reqps" => (1.0, "/s"),
        _ => (1.0, ""),
    }
}

/// A number for an axis label: three significant digits at most, thousands as k.
fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 10_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if a >= 100.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// Draws `panels` into an SVG at `path`, under `title`.
pub fn draw(title: &str, panels: &[Panel], range: Duration, path: &Path) -> anyhow::Result<()> {
    let bottom = panels.iter().map(|p| p.grid.1 + p.grid.3).max().unwrap_or(1);
    let (width, height) = (24 * COLUMN, bottom * ROW + 40);
    let root = SVGBackend::new(path, (width, height)).into_drawing_area();
    root.fill(&WHITE)?;
    root.draw_text(title, &("sans-serif", 22).into_text_style(&root), (10, 8))?;
    let body = root.margin(40, 0, 0, 0);
    for panel in panels {
        let (x, y, w, h) = panel.grid;
        let area = body.clone().shrink((x * COLUMN, y * ROW), (w * COLUMN, h * ROW));
        if panel.kind == "row" {
            area.draw_text(&panel.title, &("sans-serif", 18).into_text_style(&area).color(&BLACK), (6, 6))?;
            continue;
        }
        draw_panel(&area.margin(4, 4, 4, 4), panel, range)?;
    }
    root.present()?;
    Ok(())
}

fn draw_panel(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    panel: &Panel,
    range: Duration,
) -> anyhow::Result<()> {
    area.fill(&RGBColor(250, 250, 250))?;
    let raw_top = panel.lines.iter().flat_map(|l| l.points.iter().map(|&(_, v)| v)).fold(f64::NEG_INFINITY, f64::max);
    let (factor, suffix) = scale(&panel.unit, raw_top);
    let top = raw_top * factor;
    let span = range.as_secs_f64();
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 14))
        .margin(4)
        .x_label_area_size(18)
        .y_label_area_size(50)
        .build_cartesian_2d(-span..0.0, 0.0..if top.is_finite() && top > 0.0 { top * 1.15 } else { 1.0 })?;
    chart
        .configure_mesh()
        .x_labels(4)
        .y_labels(4)
        .x_label_formatter(&|t| format!("{t:.0}s"))
        .y_label_formatter(&|v| format!("{}{suffix}", short(*v)))
        .label_style(("sans-serif", 10))
        .draw()?;
    if !top.is_finite() {
        area.draw_text("no data", &("sans-serif", 16).into_text_style(area).color(&RED), (20, 40))?;
        return Ok(());
    }
    for (i, line) in panel.lines.iter().enumerate().take(COLOURS.len()) {
        let colour = COLOURS[i % COLOURS.len()];
        let points: Vec<(f64, f64)> = line.points.iter().map(|&(t, v)| (t, v * factor)).collect();
        chart
            .draw_series(LineSeries::new(points, colour.stroke_width(2)))?
            .label(line.legend.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], colour.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 10))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_legend_names_its_series_by_label() {
        let labels: BTreeMap<String, String> = [("state".to_owned(), "ready".to_owned())].into();
        assert_eq!(legend("{{state}} pods", &labels), "ready pods");
        assert_eq!(legend("{{ pod }}", &labels), "");
        assert_eq!(legend("p99", &labels), "p99");
    }

    #[test]
    fn axis_numbers_keep_three_digits() {
        assert_eq!([0.0, 0.25, 2.5, 25.0, 250.0, 25_000.0].map(short), ["0", "0.250", "2.50", "25.0", "250", "25k"]);
    }

    #[test]
    fn seconds_read_as_milliseconds_only_below_one_second() {
        assert_eq!(scale("s", 0.25), (1000.0, "ms"));
        assert_eq!(scale("s", 60.0), (1.0, "s"));
        assert_eq!(scale("percentunit", 0.5), (100.0, "%"));
    }

    #[test]
    fn variables_become_all_unless_given() {
        let vars: BTreeMap<String, String> = [("namespace".to_owned(), "ml".to_owned())].into();
        let expr = r#"rate(x{namespace=~"$namespace", model=~"${model}"}[$__rate_interval])"#;
        assert_eq!(substitute(expr, "1m", &vars), r#"rate(x{namespace=~"ml", model=~".*"}[1m])"#);
    }

    #[test]
    fn a_range_answer_becomes_lines_relative_to_its_end_without_nan() {
        let answer = json!({"status": "success", "data": {"resultType": "matrix", "result": [
            {"metric": {"state": "ready"}, "values": [[100.0, "1"], [110.0, "NaN"], [120.0, "3"]]},
        ]}});
        let got = lines(&answer, "{{state}}", 120.0).unwrap();
        assert_eq!(got, vec![Line { legend: "ready".into(), points: vec![(-20.0, 1.0), (0.0, 3.0)] }]);
        assert!(lines(&json!({"status": "error", "error": "bad"}), "", 0.0).is_err());
    }
}
