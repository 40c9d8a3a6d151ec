//! Routing templates: `{app_code}.{event_type}` and friends (SPEC §5).

use std::fmt;

use serde::{Deserialize, Deserializer};

use crate::EventRecord;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    AppCode,
    EventType,
    AggregateId,
}

/// A parsed template. Parsing refuses unknown placeholders and unbalanced
/// braces, so a bad template is a config error at start, not at publish.
///
/// ```
/// use postbox_core::template::Template;
/// let t = Template::parse("{app_code}.{event_type}").unwrap();
/// assert!(Template::parse("{nope}").is_err());
/// # let _ = t;
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

impl Template {
    /// Parses `source`.
    pub fn parse(source: &str) -> Result<Self, String> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = source.chars();
        while let Some(c) = chars.next() {
            match c {
                '{' => {
                    let name: String = chars.by_ref().take_while(|&c| c != '}').collect();
                    let part = match name.as_str() {
                        "app_code" => Part::AppCode,
                        "event_type" => Part::EventType,
                        "aggregate_id" => Part::AggregateId,
                        other => {
                            return Err(format!(
                                "unknown placeholder `{{{other}}}` in template `{source}`: use {{app_code}}, {{event_type}} or {{aggregate_id}}"
                            ))
                        }
                    };
                    if !literal.is_empty() {
                        parts.push(Part::Literal(std::mem::take(&mut literal)));
                    }
                    parts.push(part);
                }
                '}' => return Err(format!("unmatched `}}` in template `{source}`")),
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        if parts.is_empty() {
            return Err("template is empty".to_owned());
        }
        Ok(Template {
            source: source.to_owned(),
            parts,
        })
    }

    /// Renders the template for one event. A missing `aggregate_id` renders
    /// as `_`.
    pub fn render(&self, event: &EventRecord) -> String {
        let mut out = String::with_capacity(self.source.len() + 32);
        for part in &self.parts {
            match part {
                Part::Literal(s) => out.push_str(s),
                Part::AppCode => out.push_str(&event.app_code),
                Part::EventType => out.push_str(&event.event_type),
                Part::AggregateId => out.push_str(event.aggregate_id.as_deref().unwrap_or("_")),
            }
        }
        out
    }

    /// Renders the template with every placeholder value passed through
    /// `escape` first (NATS makes each value exactly one subject token this
    /// way, whatever dots it contains).
    pub fn render_escaped(&self, event: &EventRecord, escape: impl Fn(&str) -> String) -> String {
        let mut out = String::with_capacity(self.source.len() + 32);
        for part in &self.parts {
            match part {
                Part::Literal(s) => out.push_str(s),
                Part::AppCode => out.push_str(&escape(&event.app_code)),
                Part::EventType => out.push_str(&escape(&event.event_type)),
                Part::AggregateId => {
                    out.push_str(&escape(event.aggregate_id.as_deref().unwrap_or("_")))
                }
            }
        }
        out
    }

    /// The template with every placeholder replaced by `with` (for example
    /// `*`, to derive the subjects a NATS stream captures).
    pub fn with_placeholders_as(&self, with: &str) -> String {
        let mut out = String::with_capacity(self.source.len());
        for part in &self.parts {
            match part {
                Part::Literal(s) => out.push_str(s),
                _ => out.push_str(with),
            }
        }
        out
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }
}

impl fmt::Debug for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.source)
    }
}

impl<'de> Deserialize<'de> for Template {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Template::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::Status;

    /// A row of app `room`, event `e`, type `RoomCreated`, for tests.
    pub(crate) fn record() -> EventRecord {
        EventRecord {
            id: 1,
            app_code: "room".into(),
            event_id: "e".into(),
            event_type: "RoomCreated".into(),
            payload: "{}".into(),
            status: Status::Delivering,
            ..Default::default()
        }
    }

    #[test]
    fn renders_placeholders() {
        let t = Template::parse("x.{app_code}.{event_type}.{aggregate_id}").unwrap();
        assert_eq!(t.render(&record()), "x.room.RoomCreated._");
    }

    #[test]
    fn escapes_values_and_replaces_placeholders() {
        let t = Template::parse("x.{app_code}.{aggregate_id}").unwrap();
        let mut r = record();
        r.aggregate_id = Some("a.b".into());
        assert_eq!(t.render_escaped(&r, |v| v.replace('.', "_")), "x.room.a_b");
        assert_eq!(t.with_placeholders_as("*"), "x.*.*");
    }

    #[test]
    fn refuses_bad_templates() {
        assert!(Template::parse("").is_err());
        assert!(Template::parse("{event}").unwrap_err().contains("{event}"));
        assert!(Template::parse("a}").is_err());
    }
}
