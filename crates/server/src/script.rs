//! TEST FACILITY (`serve --test-script`): replies chosen from a script
//! instead of sampled, so tests can drive tool calls, reasoning and whole
//! agent clients through the real wire formats with a model that would
//! never produce them.
//!
//! A script is a JSON list of entries:
//!
//! - a string: a reply given in turn (the plain entries cycle);
//! - `{"when": "text" | ["text", ...], "reply": "...", "times": n}`: the
//!   reply to any prompt that contains every `when` text, at most `times`
//!   times (no limit when absent). Rules are tried in order before any
//!   plain entry.
//!
//! Rules make an agent's run deterministic whatever the order of its
//! requests: its main turn (matched by the task's text and the tool block),
//! the follow-up carrying a tool result (matched by the result's text) and
//! side requests (titles, summaries: left to a plain entry) each get their
//! own reply. A prompt that no rule matches, in a script without plain
//! entries, is an error, so a tool result that never reaches the model
//! fails the request instead of looping.

use serde_json::Value;

/// One rule: the reply to prompts containing all of `when`.
#[derive(Debug, Clone, PartialEq)]
struct Rule<R> {
    when: Vec<String>,
    reply: R,
    /// Uses left; `None`: unlimited.
    times_left: Option<usize>,
}

/// A test script; `R` is the reply's form (text as read, token ids as
/// played).
#[derive(Debug, Clone, PartialEq)]
pub struct Script<R> {
    rules: Vec<Rule<R>>,
    plain: Vec<R>,
    next_plain: usize,
}

impl Script<String> {
    /// Plain replies only, given in turn (cycling).
    pub fn in_turn(replies: Vec<String>) -> Self {
        Script {
            rules: Vec::new(),
            plain: replies,
            next_plain: 0,
        }
    }

    /// Reads a script file's JSON (the form in the module doc).
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| format!("the script is not JSON: {e}"))?;
        let entries = v
            .as_array()
            .ok_or("the script must be a JSON list of replies")?;
        let mut script = Script::in_turn(Vec::new());
        for (i, e) in entries.iter().enumerate() {
            match e {
                Value::String(s) => script.plain.push(s.clone()),
                Value::Object(o) => {
                    if let Some(k) = o
                        .keys()
                        .find(|k| !["when", "reply", "times"].contains(&k.as_str()))
                    {
                        return Err(format!(
                            "entry {i}: unknown field `{k}` (when, reply, times)"
                        ));
                    }
                    let reply = o
                        .get("reply")
                        .and_then(Value::as_str)
                        .ok_or_else(|| format!("entry {i}: `reply` must be a string"))?;
                    let when = match o.get("when") {
                        Some(Value::String(s)) => vec![s.clone()],
                        Some(Value::Array(a)) => a
                            .iter()
                            .map(|w| w.as_str().map(str::to_string))
                            .collect::<Option<Vec<_>>>()
                            .ok_or_else(|| format!("entry {i}: `when` must hold strings"))?,
                        _ => {
                            return Err(format!(
                                "entry {i}: `when` must be a string or a list of strings"
                            ))
                        }
                    };
                    let times_left = match o.get("times") {
                        None => None,
                        Some(t) => Some(
                            t.as_u64()
                                .filter(|&n| n > 0)
                                .and_then(|n| usize::try_from(n).ok())
                                .ok_or_else(|| {
                                    format!("entry {i}: `times` must be a positive integer")
                                })?,
                        ),
                    };
                    script.rules.push(Rule {
                        when,
                        reply: reply.to_string(),
                        times_left,
                    });
                }
                _ => return Err(format!("entry {i}: expected a string or an object")),
            }
        }
        if script.rules.is_empty() && script.plain.is_empty() {
            return Err("the script has no replies".into());
        }
        Ok(script)
    }
}

impl<R: Clone> Script<R> {
    /// The same script with every reply converted (e.g. tokenized).
    pub fn try_map<S, E>(self, mut f: impl FnMut(&R) -> Result<S, E>) -> Result<Script<S>, E> {
        let mut rules = Vec::with_capacity(self.rules.len());
        for r in &self.rules {
            rules.push(Rule {
                when: r.when.clone(),
                reply: f(&r.reply)?,
                times_left: r.times_left,
            });
        }
        let plain = self.plain.iter().map(&mut f).collect::<Result<_, _>>()?;
        Ok(Script {
            rules,
            plain,
            next_plain: self.next_plain,
        })
    }

    /// True when replies depend on the prompt (the caller must then pass
    /// its text to [`Script::reply_to`]).
    pub fn reads_prompts(&self) -> bool {
        !self.rules.is_empty()
    }

    /// The reply to a prompt, counting the use; `None` when no rule
    /// matches and there is no plain entry.
    pub fn reply_to(&mut self, prompt: &str) -> Option<R> {
        let hit = self.rules.iter_mut().enumerate().find(|(_, r)| {
            r.times_left != Some(0) && r.when.iter().all(|w| prompt.contains(w.as_str()))
        });
        if let Some((i, rule)) = hit {
            if let Some(n) = &mut rule.times_left {
                *n -= 1;
            }
            tracing::info!(
                "test script: rule {i} answers a {}-byte prompt",
                prompt.len()
            );
            return Some(rule.reply.clone());
        }
        if self.plain.is_empty() {
            return None;
        }
        let reply = self.plain[self.next_plain % self.plain.len()].clone();
        self.next_plain += 1;
        Some(reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_entries_cycle() {
        let mut s = Script::from_json(r#"["a", "b"]"#).unwrap();
        assert!(!s.reads_prompts());
        let got: Vec<_> = (0..5).map(|_| s.reply_to("").unwrap()).collect();
        assert_eq!(got, ["a", "b", "a", "b", "a"]);
    }

    #[test]
    fn rules_match_all_texts_in_order_and_count_uses() {
        let mut s = Script::from_json(
            r#"[{"when": ["task", "RESULT"], "reply": "final", "times": 1},
                {"when": ["task", "<tools>"], "reply": "call", "times": 1},
                "title"]"#,
        )
        .unwrap();
        assert!(s.reads_prompts());
        // A side request (no tools) gets the plain entry, whenever it comes.
        assert_eq!(s.reply_to("title for: task").unwrap(), "title");
        assert_eq!(s.reply_to("<tools> task").unwrap(), "call");
        // The same turn again (the tool result did not come back): the rule
        // is spent, the plain entry answers.
        assert_eq!(s.reply_to("<tools> task").unwrap(), "title");
        assert_eq!(s.reply_to("<tools> task ... RESULT").unwrap(), "final");
        assert_eq!(s.reply_to("<tools> task ... RESULT").unwrap(), "title");
    }

    #[test]
    fn no_match_without_plain_entries_is_none() {
        let mut s = Script::from_json(r#"[{"when": "x", "reply": "y"}]"#).unwrap();
        assert_eq!(s.reply_to("abc"), None);
        assert_eq!(s.reply_to("xyz").as_deref(), Some("y"));
        assert_eq!(
            s.reply_to("xyz").as_deref(),
            Some("y"),
            "no `times`: unlimited"
        );
    }

    #[test]
    fn try_map_keeps_rules_and_order() {
        let s = Script::from_json(r#"[{"when": "k", "reply": "abc"}, "de"]"#).unwrap();
        let mut t = s.try_map(|r| Ok::<_, ()>(r.len())).unwrap();
        assert_eq!(t.reply_to("k"), Some(3));
        assert_eq!(t.reply_to("z"), Some(2));
    }

    #[test]
    fn bad_scripts_are_refused_with_the_entry() {
        for (text, want) in [
            ("{}", "JSON list"),
            ("[]", "no replies"),
            ("[3]", "entry 0"),
            (r#"["a", {"reply": "x"}]"#, "entry 1: `when`"),
            (r#"[{"when": "a"}]"#, "`reply`"),
            (r#"[{"when": [1], "reply": "x"}]"#, "hold strings"),
            (r#"[{"when": "a", "reply": "x", "times": 0}]"#, "`times`"),
            (
                r#"[{"when": "a", "reply": "x", "then": 1}]"#,
                "unknown field `then`",
            ),
            ("[", "not JSON"),
        ] {
            let e = Script::from_json(text).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
    }
}
