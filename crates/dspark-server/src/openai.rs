//! The OpenAI wire format: request bodies, their validation, and the error shape.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn status(mut self, s: StatusCode) -> Self {
        self.status = s;
        self
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The parameters chat and text completions share.
#[derive(Debug, Deserialize)]
pub struct Common {
    pub model: String,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Not in OpenAI's API; vLLM and llama.cpp accept it.
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub stop: Option<OneOrMany>,
    /// `{"tag": "code"}` routes the request to that workload's online calibration.
    #[serde(default)]
    pub metadata: Option<serde_json::Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// `true` to get each emitted token's log-probability (kept as JSON so that a wrong type
    /// gets a message naming the field).
    #[serde(default)]
    pub logprobs: Option<Value>,
    /// 0 to 20 alternatives per token; needs `logprobs: true`.
    #[serde(default)]
    pub top_logprobs: Option<Value>,
    #[serde(flatten)]
    pub common: Common,
}

/// The most alternatives `/v1/completions` returns per token (`logprobs`), as in OpenAI's API.
pub const MAX_COMPLETION_LOGPROBS: usize = 5;

impl ChatRequest {
    /// `None` without log-probabilities, else the number of alternatives per token.
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        let on = match &self.logprobs {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(ApiError::invalid(
                    format!(
                        "logprobs must be true or false for chat completions (got {v}); \
                         ask for alternatives with top_logprobs"
                    ),
                    Some("logprobs"),
                ))
            }
        };
        let top = match &self.top_logprobs {
            None | Some(Value::Null) => None,
            Some(v) => Some(count(v, dspark_engine::MAX_TOP_LOGPROBS, "top_logprobs")?),
        };
        match (on, top) {
            (false, Some(_)) => {
                Err(ApiError::invalid("top_logprobs needs logprobs: true; set both", Some("top_logprobs")))
            }
            (false, None) => Ok(None),
            (true, top) => Ok(Some(top.unwrap_or(0))),
        }
    }
}

/// An integer in `0..=max` for the field `name`.
fn count(v: &Value, max: usize, name: &'static str) -> Result<usize, ApiError> {
    match v.as_u64() {
        Some(n) if n <= max as u64 => Ok(n as usize),
        _ => {
            Err(ApiError::invalid(format!("{name} must be an integer from 0 to {max} (got {v})"), Some(name)))
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: OneOrMany,
    /// Not in OpenAI's API: parse special-token text such as `<|im_start|>` in the prompt into
    /// control tokens (for callers that write their own chat markup). Off by default, so that
    /// text relayed from users cannot forge control tokens.
    #[serde(default)]
    pub parse_special: bool,
    /// The number of alternatives per token whose log-probabilities come back with the emitted
    /// tokens' (0 to 5).
    #[serde(default)]
    pub logprobs: Option<Value>,
    #[serde(flatten)]
    pub common: Common,
}

impl CompletionRequest {
    pub fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        match &self.logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(v @ Value::Bool(_)) => Err(ApiError::invalid(
                format!(
                    "logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS} for completions \
                     (got {v}): the number of alternatives per token"
                ),
                Some("logprobs"),
            )),
            Some(v) => count(v, MAX_COMPLETION_LOGPROBS, "logprobs").map(Some),
        }
    }
}

/// Parses a body, telling malformed JSON apart from a well-formed body of the wrong shape.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object", None));
    }
    serde_json::from_value(v).map_err(|e| ApiError::invalid(format!("invalid request: {e}"), None))
}

/// Validated sampling settings.
#[derive(Debug)]
pub struct Settings {
    pub max_tokens: Option<usize>,
    pub temperature: f64,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub seed: u64,
    pub stop: Vec<String>,
    pub tag: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Alternatives per token when log-probabilities are asked for (set by the endpoint: chat
    /// and completions spell the option differently).
    pub logprobs: Option<usize>,
}

impl Common {
    pub fn settings(&self) -> Result<Settings, ApiError> {
        let max = self.max_completion_tokens.or(self.max_tokens);
        if let Some(m) = max {
            if m < 1 {
                return Err(ApiError::invalid(
                    format!("max_tokens must be at least 1 (got {m})"),
                    Some("max_tokens"),
                ));
            }
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                format!("temperature must be between 0 and 2 (got {temperature})"),
                Some("temperature"),
            ));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::invalid(format!("top_p must be in (0, 1] (got {p})"), Some("top_p")));
            }
        }
        if let Some(k) = self.top_k {
            if k < 0 {
                return Err(ApiError::invalid(
                    format!("top_k must be 0 (off) or positive (got {k})"),
                    Some("top_k"),
                ));
            }
        }
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::invalid(format!("only n = 1 is supported (got {n})"), Some("n")));
            }
        }
        let stop = self.stop.clone().map(OneOrMany::into_vec).unwrap_or_default();
        let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
        if stop.len() > 4 {
            return Err(ApiError::invalid("at most 4 stop sequences are allowed", Some("stop")));
        }
        let tag = match self.metadata.as_ref().and_then(|m| m.get("tag")) {
            None => None,
            Some(Value::String(t)) if !t.is_empty() && t.len() <= 64 => Some(t.clone()),
            Some(_) => {
                return Err(ApiError::invalid(
                    "metadata.tag must be a string of 1 to 64 characters",
                    Some("metadata"),
                ))
            }
        };
        Ok(Settings {
            max_tokens: max.map(|m| m as usize),
            temperature,
            top_p: self.top_p,
            top_k: self.top_k.filter(|&k| k > 0).map(|k| k as usize),
            seed: self.seed.map_or_else(rand_seed, |s| s as u64),
            stop,
            tag,
            stream: self.stream,
            include_usage: self.stream_options.as_ref().is_some_and(|o| o.include_usage),
            logprobs: None,
        })
    }
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

impl ChatRequest {
    /// The messages as (role, text) pairs.
    pub fn turns(&self) -> Result<Vec<(String, String)>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages must contain at least one message", Some("messages")));
        }
        self.messages
            .iter()
            .map(|m| {
                if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant") {
                    return Err(ApiError::invalid(
                        format!("unknown message role `{}`: use system, user or assistant", m.role),
                        Some("messages"),
                    ));
                }
                let text = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut s = String::new();
                        for p in parts {
                            if p.kind != "text" {
                                return Err(ApiError::invalid(
                                    format!(
                                        "content parts of type `{}` are not supported; send text",
                                        p.kind
                                    ),
                                    Some("messages"),
                                ));
                            }
                            s += p.text.as_deref().unwrap_or("");
                        }
                        s
                    }
                };
                let role = if m.role == "developer" { "system".to_string() } else { m.role.clone() };
                Ok((role, text))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_validates() {
        let r: ChatRequest =
            parse(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stop":"x"}"#).unwrap();
        let s = r.common.settings().unwrap();
        assert_eq!((s.stop, s.temperature, s.max_tokens), (vec!["x".to_string()], 1.0, None));
        assert!(parse::<ChatRequest>(b"{oops").unwrap_err().message.contains("not valid JSON"));
        assert!(parse::<ChatRequest>(b"[1]").unwrap_err().message.contains("JSON object"));
        assert!(parse::<ChatRequest>(br#"{"model":"m"}"#).unwrap_err().message.contains("messages"));
        let bad = |field: &str| {
            let body = format!(r#"{{"model":"m","prompt":"p",{field}}}"#);
            parse::<CompletionRequest>(body.as_bytes()).unwrap().common.settings().unwrap_err().param
        };
        assert_eq!(bad(r#""temperature":3"#), Some("temperature"));
        assert_eq!(bad(r#""top_p":0"#), Some("top_p"));
        assert_eq!(bad(r#""max_tokens":0"#), Some("max_tokens"));
        assert_eq!(bad(r#""n":2"#), Some("n"));
        let chat_lp = |extra: &str| {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
            parse::<ChatRequest>(body.as_bytes()).unwrap().logprobs()
        };
        assert_eq!(chat_lp("").unwrap(), None);
        assert_eq!(chat_lp(r#","logprobs":false"#).unwrap(), None);
        assert_eq!(chat_lp(r#","logprobs":true"#).unwrap(), Some(0));
        assert_eq!(chat_lp(r#","logprobs":true,"top_logprobs":20"#).unwrap(), Some(20));
        for bad in [
            r#","logprobs":true,"top_logprobs":21"#,
            r#","logprobs":true,"top_logprobs":-1"#,
            r#","logprobs":true,"top_logprobs":2.5"#,
            r#","logprobs":true,"top_logprobs":"3""#,
            r#","top_logprobs":3"#,
            r#","logprobs":5"#,
            r#","logprobs":"yes""#,
        ] {
            let e = chat_lp(bad).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
            assert!(e.message.contains("logprobs"), "{bad}: {}", e.message);
        }
        let text_lp = |extra: &str| {
            let body = format!(r#"{{"model":"m","prompt":"p"{extra}}}"#);
            parse::<CompletionRequest>(body.as_bytes()).unwrap().logprobs()
        };
        assert_eq!(text_lp("").unwrap(), None);
        assert_eq!(text_lp(r#","logprobs":0"#).unwrap(), Some(0));
        assert_eq!(text_lp(r#","logprobs":5"#).unwrap(), Some(5));
        for bad in [r#","logprobs":6"#, r#","logprobs":-1"#, r#","logprobs":true"#, r#","logprobs":1e30"#] {
            assert_eq!(text_lp(bad).unwrap_err().param, Some("logprobs"), "{bad}");
        }
        let parts: ChatRequest = parse(
            br#"{"model":"m","messages":[{"role":"developer","content":[{"type":"text","text":"a"}]}]}"#,
        )
        .unwrap();
        assert_eq!(parts.turns().unwrap(), vec![("system".to_string(), "a".to_string())]);
    }
}
