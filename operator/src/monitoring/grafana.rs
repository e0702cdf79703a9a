//! A dashboard in Grafana's JSON model (schema 39): a `datasource` variable every panel and
//! query variable reads through (so one file works with any Prometheus data source), query
//! variables chained from namespace down, rows, and a grid that places panels three to a line.
//! Written by hand: the Grafana Foundation SDK has no Rust binding, and the model is a handful of
//! fields.

use serde_json::{json, Value};

/// The data source every panel and variable uses.
fn datasource() -> Value {
    json!({"type": "prometheus", "uid": "${datasource}"})
}

/// One series of a panel: a PromQL expression and its legend.
pub struct Query {
    pub expr: String,
    pub legend: String,
}

pub fn query(expr: impl Into<String>, legend: impl Into<String>) -> Query {
    Query { expr: expr.into(), legend: legend.into() }
}

/// A dashboard being laid out.
pub struct Board {
    uid: &'static str,
    title: &'static str,
    description: &'static str,
    variables: Vec<Value>,
    panels: Vec<Value>,
    next_id: u64,
    x: u64,
    y: u64,
}

const WIDTH: u64 = 8;
const HEIGHT: u64 = 8;

impl Board {
    pub fn new(uid: &'static str, title: &'static str, description: &'static str) -> Self {
        let source = json!({
            "name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": [],
        });
        Board { uid, title, description, variables: vec![source], panels: Vec::new(), next_id: 1, x: 0, y: 0 }
    }

    /// A variable whose values are `label`'s on `metric` under the variables before it
    /// (`selector`); all of them by default.
    pub fn variable(mut self, label: &str, title: &str, metric: &str, selector: &str) -> Self {
        let definition = format!("label_values({metric}{selector}, {label})");
        self.variables.push(json!({
            "name": label, "label": title, "type": "query", "datasource": datasource(),
            "definition": definition, "query": {"query": definition, "refId": label},
            "refresh": 2, "includeAll": true, "multi": true, "allValue": ".*", "sort": 1,
            "current": {"selected": true, "text": ["All"], "value": ["$__all"]}, "options": [], "hide": 0,
        }));
        self
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id - 1
    }

    /// A row heading; the panels after it start on a new line.
    pub fn row(mut self, title: &str) -> Self {
        if self.x > 0 {
            self.x = 0;
            self.y += HEIGHT;
        }
        let id = self.id();
        self.panels.push(json!({
            "id": id, "type": "row", "title": title, "collapsed": false, "panels": [],
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
        }));
        self.y += 1;
        self
    }

    /// A time-series panel of `queries` in `unit` (Grafana's unit ids: `reqps`, `s`, `percentunit`, `short`).
    pub fn panel(mut self, title: &str, description: &str, unit: &str, queries: Vec<Query>) -> Self {
        let id = self.id();
        let targets: Vec<Value> = queries
            .iter()
            .zip('A'..='Z')
            .map(|(q, ref_id)| {
                json!({"refId": ref_id.to_string(), "expr": q.expr, "legendFormat": q.legend, "datasource": datasource()})
            })
            .collect();
        let mut defaults = json!({"unit": unit, "min": 0, "custom": {"lineWidth": 1, "fillOpacity": 10}});
        if unit == "percentunit" {
            defaults["max"] = json!(1);
        }
        self.panels.push(json!({
            "id": id, "type": "timeseries", "title": title, "description": description,
            "datasource": datasource(), "targets": targets,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": true},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "gridPos": {"h": HEIGHT, "w": WIDTH, "x": self.x, "y": self.y},
        }));
        self.x += WIDTH;
        if self.x >= 24 {
            self.x = 0;
            self.y += HEIGHT;
        }
        self
    }

    pub fn build(self) -> Value {
        json!({
            "uid": self.uid, "title": self.title, "description": self.description,
            "tags": ["ferry"], "editable": true, "schemaVersion": 39, "version": 1,
            "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "browser",
            "graphTooltip": 1, "annotations": {"list": []}, "links": [],
            "templating": {"list": self.variables}, "panels": self.panels,
        })
    }
}
