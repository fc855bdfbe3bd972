//! What `slipstream bench agent` writes: one row per request per server
//! (CSV and JSON), a side-by-side markdown table, and two charts (time to
//! first token per request; time elapsed in the session).

use serde::Serialize;

use super::client::Measured;
use super::transcript::{Api, Kind};
use crate::chart::{Chart, Series};
use crate::machine::{Load, Stamp};
use crate::report::{csv_field, csv_lines, fixed_or_blank, or_blank};

/// One request as one server answered it.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// 1-based position in the replay.
    pub index: usize,
    pub label: String,
    pub kind: Kind,
    /// When it was sent, seconds after the session's first request.
    pub started_s: f64,
    #[serde(flatten)]
    pub measured: Measured,
    /// Prompt tokens prefilled: prompt tokens less reused ones.
    pub new_tokens: Option<u64>,
    /// `1.2 x new tokens / prefill rate + 1 s`, on the first server's rows.
    pub ttft_bound_s: Option<f64>,
    pub within_bound: Option<bool>,
}

/// One server's replay of the whole transcript.
#[derive(Clone, Debug, Serialize)]
pub struct Session {
    /// `slipstream`, `llama.cpp`, or the name given.
    pub runtime: String,
    pub base_url: String,
    /// The command the bench started the server with, if it did.
    pub command: Option<String>,
    /// The model name sent in requests.
    pub model: String,
    /// Seconds from starting the server until `/health` answered.
    pub startup_s: Option<f64>,
    /// Seconds of the one-token request sent before the session (not counted).
    pub warmup_s: Option<f64>,
    /// From sending the first request until the last one's stream ended.
    pub session_s: f64,
    pub failed_requests: usize,
    /// VmHWM of a server the bench started, read after the session.
    pub peak_rss_bytes: Option<u64>,
    /// Over the session.
    #[serde(flatten)]
    pub load: Load,
    pub rows: Vec<Row>,
}

/// The time-to-first-token check of the first server's rows.
#[derive(Clone, Debug, Serialize)]
pub struct BoundCheck {
    /// Prefill tokens per second the bound is computed from.
    pub prefill_rate_tok_s: f64,
    /// `--prefill-rate`, or which request it was measured on.
    pub rate_source: String,
    pub within: usize,
    pub checked: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct Meta {
    #[serde(flatten)]
    pub stamp: Stamp,
    /// The transcript file, or `bundled`.
    pub transcript: String,
    pub requests: usize,
    pub api: Api,
    pub max_tokens: usize,
    pub threads: usize,
    pub ctx_size: usize,
    pub finished: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct AgentReport {
    pub meta: Meta,
    pub sessions: Vec<Session>,
    /// Second session's time / first session's, when both finished every request.
    pub speedup: Option<f64>,
    pub bound: Option<BoundCheck>,
}

impl AgentReport {
    /// Fills the bound check on the first session (with `rate`, else the
    /// rate of its request with the most new tokens) and the speedup.
    pub fn settle(&mut self, rate: Option<f64>) {
        self.bound = None;
        if let Some(first) = self.sessions.first_mut() {
            let measured = first
                .rows
                .iter()
                .filter(|r| r.measured.error.is_none())
                .filter_map(|r| Some((r, r.new_tokens?, r.measured.ttft_s?)))
                .filter(|(_, n, t)| *n > 0 && *t > 0.0)
                .max_by_key(|(_, n, _)| *n)
                .map(|(r, n, t)| {
                    (
                        n as f64 / t,
                        format!("measured on {} ({n} new tokens)", r.label),
                    )
                });
            let chosen = match rate {
                Some(r) => Some((r, "--prefill-rate".to_string())),
                None => measured,
            };
            if let Some((rate, source)) = chosen.filter(|(r, _)| *r > 0.0) {
                let (mut within, mut checked) = (0, 0);
                for row in &mut first.rows {
                    row.ttft_bound_s = None;
                    row.within_bound = None;
                    if let (Some(n), Some(t), None) =
                        (row.new_tokens, row.measured.ttft_s, &row.measured.error)
                    {
                        let bound = 1.2 * n as f64 / rate + 1.0;
                        row.ttft_bound_s = Some(bound);
                        row.within_bound = Some(t <= bound);
                        checked += 1;
                        within += usize::from(t <= bound);
                    }
                }
                self.bound = Some(BoundCheck {
                    prefill_rate_tok_s: rate,
                    rate_source: source,
                    within,
                    checked,
                });
            }
        }
        self.speedup = match self.sessions.as_slice() {
            [a, b, ..]
                if a.failed_requests == 0
                    && b.failed_requests == 0
                    && a.rows.len() == self.meta.requests
                    && b.rows.len() == self.meta.requests
                    && a.session_s > 0.0 =>
            {
                Some(b.session_s / a.session_s)
            }
            _ => None,
        };
    }
}

/// One line per request per server, with a header.
pub fn csv(report: &AgentReport) -> String {
    let rows = report.sessions.iter().flat_map(|s| {
        s.rows.iter().map(|r| {
            let m = &r.measured;
            [
                csv_field(&s.runtime),
                r.index.to_string(),
                csv_field(&r.label),
                r.kind.name().to_string(),
                or_blank(m.prompt_tokens),
                or_blank(m.reused_tokens),
                or_blank(r.new_tokens),
                fixed_or_blank(m.ttft_s, 3),
                fixed_or_blank(m.server_prefill_s, 3),
                format!("{:.3}", m.total_s),
                or_blank(m.completion_tokens),
                format!("{:.3}", r.started_s),
                fixed_or_blank(r.ttft_bound_s, 3),
                or_blank(r.within_bound),
                report.meta.stamp.commit.clone(),
                csv_field(m.error.as_deref().unwrap_or("")),
            ]
        })
    });
    csv_lines(
        "runtime,index,label,kind,prompt_tokens,reused_tokens,new_tokens,ttft_s,server_prefill_s,total_s,completion_tokens,started_s,ttft_bound_s,within_bound,commit,error",
        rows,
    )
}

/// The per-request table, the sessions' times and the bound check.
pub fn markdown(report: &AgentReport) -> String {
    let mut out = String::from("| # | request |");
    let mut rule = String::from("| ---: | --- |");
    for s in &report.sessions {
        out.push_str(&format!(
            " {0} prompt | {0} reused | {0} new | {0} TTFT s |",
            s.runtime
        ));
        rule.push_str(" ---: | ---: | ---: | ---: |");
    }
    out.push('\n');
    out.push_str(&rule);
    out.push('\n');
    let n = report
        .sessions
        .iter()
        .map(|s| s.rows.len())
        .max()
        .unwrap_or(0);
    for i in 0..n {
        let first = report.sessions.iter().find_map(|s| s.rows.get(i));
        let Some(head) = first else { continue };
        let label = match head.kind {
            Kind::Turn => head.label.clone(),
            Kind::Side => format!("{} (side)", head.label),
        };
        out.push_str(&format!("| {} | {label} |", head.index));
        for s in &report.sessions {
            match s.rows.get(i) {
                Some(r) => {
                    let m = &r.measured;
                    let ttft = match (&m.error, m.ttft_s) {
                        (Some(_), _) => "failed".to_string(),
                        (None, Some(t)) => {
                            let over = if r.within_bound == Some(false) {
                                " (over bound)"
                            } else {
                                ""
                            };
                            format!("{t:.2}{over}")
                        }
                        (None, None) => String::new(),
                    };
                    out.push_str(&format!(
                        " {} | {} | {} | {ttft} |",
                        or_blank(m.prompt_tokens),
                        or_blank(m.reused_tokens),
                        or_blank(r.new_tokens)
                    ));
                }
                None => out.push_str(" | | | |"),
            }
        }
        out.push('\n');
    }
    out.push('\n');
    for s in &report.sessions {
        out.push_str(&format!(
            "- {}: whole session {:.1} s over {} requests{}{}{}.\n",
            s.runtime,
            s.session_s,
            s.rows.len(),
            if s.failed_requests > 0 {
                format!(", {} failed", s.failed_requests)
            } else {
                String::new()
            },
            s.peak_rss_bytes.map_or(String::new(), |b| format!(
                ", peak RSS {:.2} GB",
                b as f64 / 1e9
            )),
            s.load.steal_fraction.map_or(String::new(), |f| format!(
                ", {:.1} % CPU stolen",
                f * 100.0
            )),
        ));
    }
    if let (Some(x), [a, b, ..]) = (report.speedup, report.sessions.as_slice()) {
        out.push_str(&format!(
            "- {} took {x:.2} x the time of {} for the whole session.\n",
            b.runtime, a.runtime
        ));
    }
    if let (Some(b), Some(s)) = (&report.bound, report.sessions.first()) {
        out.push_str(&format!(
            "- {}: {} of {} requests had time to first token <= 1.2 x new tokens / {:.1} tok/s + 1 s (prefill rate {}).\n",
            s.runtime, b.within, b.checked, b.prefill_rate_tok_s, b.rate_source
        ));
    }
    let m = &report.meta;
    out.push_str(&format!(
        "\n{}; transcript {} ({} requests, {} API), at most {} generated tokens a request, greedy; {} threads, context {} tokens. Time to first token is the client's: from sending the request to the first streamed chunk carrying a token or the finish reason. Reused tokens: the usage's `cached_tokens` or `cache_read_input_tokens`, llama-server's `timings.cache_n` where it sends them.\n",
        m.stamp.measured(),
        m.transcript,
        m.requests,
        match m.api {
            Api::OpenAi => "OpenAI chat",
            Api::Anthropic => "Anthropic messages",
        },
        m.max_tokens,
        m.threads,
        m.ctx_size
    ));
    out
}

/// `agent-ttft`: time to first token per request; `agent-elapsed`: seconds
/// into the session at the end of each request.
pub fn charts(report: &AgentReport) -> Vec<(&'static str, Chart)> {
    let series = |y: &dyn Fn(&Row) -> Option<f64>| -> Vec<Series> {
        report
            .sessions
            .iter()
            .map(|s| Series {
                name: s.runtime.clone(),
                points: s
                    .rows
                    .iter()
                    .filter(|r| r.measured.error.is_none())
                    .filter_map(|r| Some((r.index as f64, y(r)?)))
                    .collect(),
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    };
    vec![
        (
            "agent-ttft",
            Chart {
                title: "Agent session: time to first token per request".into(),
                x_label: "request (turns and side requests, in order)".into(),
                y_label: "seconds".into(),
                x_log: false,
                series: series(&|r| r.measured.ttft_s),
            },
        ),
        (
            "agent-elapsed",
            Chart {
                title: "Agent session: time elapsed".into(),
                x_label: "request (turns and side requests, in order)".into(),
                y_label: "seconds since the first request".into(),
                x_log: false,
                series: series(&|r| Some(r.started_s + r.measured.total_s)),
            },
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(index: usize, kind: Kind, prompt: u64, reused: u64, ttft: f64) -> Row {
        Row {
            index,
            label: format!("r{index}"),
            kind,
            started_s: index as f64,
            measured: Measured {
                ttft_s: Some(ttft),
                total_s: ttft + 0.5,
                prompt_tokens: Some(prompt),
                reused_tokens: Some(reused),
                completion_tokens: Some(8),
                server_prefill_s: None,
                error: None,
            },
            new_tokens: Some(prompt - reused),
            ttft_bound_s: None,
            within_bound: None,
        }
    }

    /// A session of the three requests of [`report`]'s transcript (a turn,
    /// a side request, a turn), each `(prompt, reused, ttft)`, over `secs`.
    fn session(name: &str, requests: [(u64, u64, f64); 3], secs: f64) -> Session {
        let kinds = [Kind::Turn, Kind::Side, Kind::Turn];
        let rows = kinds
            .into_iter()
            .zip(requests)
            .enumerate()
            .map(|(i, (kind, (prompt, reused, ttft)))| row(i + 1, kind, prompt, reused, ttft))
            .collect();
        Session {
            runtime: name.into(),
            base_url: "http://x".into(),
            command: None,
            model: "m".into(),
            startup_s: None,
            warmup_s: None,
            session_s: secs,
            failed_requests: 0,
            peak_rss_bytes: None,
            load: Load::default(),
            rows,
        }
    }

    fn report() -> AgentReport {
        AgentReport {
            meta: Meta {
                stamp: Stamp {
                    date: "d".into(),
                    commit: "c".into(),
                    commit_source: "s".into(),
                    machine: crate::machine::Machine::detect(),
                },
                transcript: "bundled".into(),
                requests: 3,
                api: Api::OpenAi,
                max_tokens: 8,
                threads: 2,
                ctx_size: 1000,
                finished: true,
            },
            sessions: vec![
                session(
                    "slipstream",
                    [(1000, 0, 10.0), (50, 0, 1.0), (1200, 1000, 5.0)],
                    20.0,
                ),
                session(
                    "llama.cpp",
                    [(1010, 0, 9.0), (52, 0, 1.0), (1215, 0, 12.0)],
                    50.0,
                ),
            ],
            speedup: None,
            bound: None,
        }
    }

    #[test]
    fn bound_speedup_and_outputs() {
        let mut r = report();
        r.settle(None);
        // 100 tok/s from request 1; request 3: 200 new tokens, bound 3.4 s, took 5.
        let b = r.bound.clone().unwrap();
        assert_eq!(b.prefill_rate_tok_s, 100.0);
        assert!(b.rate_source.contains("r1"));
        assert_eq!((b.within, b.checked), (2, 3));
        assert_eq!(r.sessions[0].rows[2].within_bound, Some(false));
        assert_eq!(r.speedup, Some(2.5));
        r.settle(Some(50.0));
        assert_eq!(r.bound.as_ref().unwrap().within, 3);

        let csv = csv(&r);
        assert_eq!(csv.lines().count(), 1 + 6);
        assert!(csv
            .lines()
            .nth(3)
            .unwrap()
            .starts_with("slipstream,3,r3,turn,1200,1000,200,5.000,"));
        let md = markdown(&r);
        assert!(md.contains("| 2 | r2 (side) |"), "{md}");
        assert!(
            md.contains("llama.cpp took 2.50 x the time of slipstream"),
            "{md}"
        );
        assert!(md.contains("3 of 3 requests"), "{md}");
        let charts = charts(&r);
        assert_eq!(charts.len(), 2);
        assert_eq!(charts[0].1.series.len(), 2);
        assert_eq!(charts[1].1.series[1].points[2], (3.0, 3.0 + 12.5));

        // A failed request: no speedup, no bound on it.
        r.sessions[1].failed_requests = 1;
        r.sessions[0].rows[1].measured.error = Some("HTTP 500".into());
        r.settle(None);
        assert_eq!(r.speedup, None);
        assert_eq!(r.bound.as_ref().unwrap().checked, 2);
        assert!(markdown(&r).contains("failed"));
    }
}
