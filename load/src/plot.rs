//! An SVG of a run: latency (p50, p99) per second above, sent and answered-in-time requests per
//! second with the target rate below.

use std::path::Path;

use plotters::prelude::*;

use crate::record::Summary;

pub fn svg(summary: &Summary, target_rate: f64, title: &str, path: &Path) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(320);
    let seconds = summary.per_second.len().max(1) as f64;
    let max_latency = summary.per_second.iter().map(|s| s.p99_ms).fold(1.0, f64::max) * 1.1;
    let mut latency = ChartBuilder::on(&top)
        .caption(format!("{title}: latency of 200 answers"), ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..seconds, 0f64..max_latency)?;
    latency.configure_mesh().x_desc("second").y_desc("ms").draw()?;
    for (name, color, pick) in [("p50", BLUE, 0), ("p99", RED, 1)] {
        let points = summary.per_second.iter().filter(|s| s.ok > 0).map(|s| {
            let y = if pick == 0 { s.p50_ms } else { s.p99_ms };
            (s.second as f64, y)
        });
        latency
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    latency.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;

    let max_rate = summary.per_second.iter().map(|s| s.sent as f64).fold(target_rate, f64::max) * 1.1;
    let mut rate = ChartBuilder::on(&bottom)
        .caption("requests per second", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..seconds, 0f64..max_rate)?;
    rate.configure_mesh().x_desc("second").y_desc("req/s").draw()?;
    rate.draw_series(LineSeries::new([(0.0, target_rate), (seconds, target_rate)], BLACK.stroke_width(1)))?
        .label("target")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    let sent = summary.per_second.iter().map(|s| (s.second as f64, s.sent as f64));
    rate.draw_series(LineSeries::new(sent, BLUE.stroke_width(2)))?
        .label("sent")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    let ok = summary.per_second.iter().map(|s| (s.second as f64, s.ok as f64));
    rate.draw_series(LineSeries::new(ok, GREEN.stroke_width(2)))?
        .label("200")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], GREEN));
    rate.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}
