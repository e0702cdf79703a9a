//! Summaries as text: a table for people, a line of Markdown for BENCHMARKS.md.

use std::fmt::Write;

use crate::record::Summary;

/// Each tenant's line: what it sent, its goodput and its latency.
pub fn tenants(by_tenant: &[(String, Summary)]) -> String {
    let mut out = String::from("by tenant\n");
    for (name, s) in by_tenant {
        let statuses: Vec<String> = s.statuses.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        let p99 = s.latency_ms.as_ref().map_or_else(|| "-".to_owned(), |p| format!("{:.1} ms", p.p99));
        let _ = writeln!(
            out,
            "  {name:<16} sent {:>7}   goodput {:>8.1} req/s   within deadline {:>6.2} %   p99 {p99}   ({})",
            s.sent,
            s.goodput_rps,
            s.within_deadline * 100.0,
            statuses.join(", ")
        );
    }
    out
}

pub fn table(s: &Summary) -> String {
    let mut out = String::new();
    let statuses: Vec<String> = s.statuses.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    let _ = writeln!(out, "requests        {} in {:.1} s ({})", s.sent, s.duration_s, statuses.join(", "));
    let _ = writeln!(out, "goodput         {:.1} req/s answered 200 within their deadline", s.goodput_rps);
    let _ = writeln!(
        out,
        "within deadline {:.2} %   rejected early {:.2} %",
        s.within_deadline * 100.0,
        s.rejected * 100.0
    );
    let _ = writeln!(out, "late 200s       {} (client clock), {} (server-timing)", s.late_client, s.late_server);
    if let Some(p) = &s.latency_ms {
        let _ = writeln!(
            out,
            "latency (200)   p50 {:.1} ms   p90 {:.1} ms   p99 {:.1} ms   p99.9 {:.1} ms   max {:.1} ms",
            p.p50, p.p90, p.p99, p.p999, p.max
        );
    }
    if let Some(fill) = s.batch_fill {
        let _ = writeln!(out, "batch fill      {:.1} %", fill * 100.0);
    }
    out
}
