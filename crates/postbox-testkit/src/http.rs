//! A minimal HTTP/1.1 client for admin API tests (one request per
//! connection, `Connection: close`), and a Prometheus text-format parser.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A response: status code and body text.
#[derive(Debug, Clone)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// Header lines, lowercase names.
    pub headers: Vec<(String, String)>,
    /// Body (not chunked: servers answer `Connection: close` requests with
    /// a length or by closing).
    pub body: String,
}

impl Response {
    /// The body as JSON; panics with the body when it is not.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// Sends `method path` with `headers` to `addr`.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Response {
    request_with(addr, method, path, headers, None).await
}

/// [`request`] with a JSON `body`, if any.
pub async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&serde_json::Value>,
) -> Response {
    let mut stream = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let body = body.map_or(String::new(), |b| b.to_string());
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    stream
        .write_all(req.as_bytes())
        .await
        .expect("send request");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read response");
    let text = String::from_utf8(raw).expect("UTF-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("response head");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    Response {
        status,
        headers,
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").expect("chunk size line");
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            return out;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
}

/// One sample of a Prometheus text exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name (with `_bucket`/`_sum`/`_count` for histograms).
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Value.
    pub value: f64,
}

/// Parses the Prometheus text format (0.0.4), strictly: every line is a
/// comment (`# HELP`/`# TYPE` well formed), blank, or a sample with a valid
/// name, well-quoted labels and a float value. Errors name the line.
pub fn parse_prometheus(text: &str) -> Result<Vec<Sample>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = |why: &str| format!("line {}: {why}: {line}", i + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(c) = line.strip_prefix('#') {
            let mut parts = c.trim_start().splitn(3, ' ');
            match parts.next() {
                Some("HELP") => {
                    let name = parts.next().ok_or_else(|| at("HELP without a name"))?;
                    valid_name(name).map_err(|e| at(&e))?;
                }
                Some("TYPE") => {
                    let name = parts.next().ok_or_else(|| at("TYPE without a name"))?;
                    valid_name(name).map_err(|e| at(&e))?;
                    let ty = parts.next().unwrap_or("");
                    if !matches!(
                        ty,
                        "counter" | "gauge" | "histogram" | "summary" | "untyped"
                    ) {
                        return Err(at("unknown TYPE"));
                    }
                }
                _ => {}
            }
            continue;
        }
        let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value"))?;
        let name = &line[..name_end];
        valid_name(name).map_err(|e| at(&e))?;
        let mut rest = &line[name_end..];
        let mut labels = BTreeMap::new();
        if let Some(r) = rest.strip_prefix('{') {
            let mut r = r;
            loop {
                r = r.trim_start_matches(',');
                if let Some(after) = r.strip_prefix('}') {
                    rest = after;
                    break;
                }
                let eq = r.find('=').ok_or_else(|| at("label without ="))?;
                let key = &r[..eq];
                valid_name(key).map_err(|e| at(&e))?;
                let v = r[eq + 1..]
                    .strip_prefix('"')
                    .ok_or_else(|| at("label value not quoted"))?;
                let mut value = String::new();
                let mut chars = v.char_indices();
                let end = loop {
                    match chars.next() {
                        Some((_, '\\')) => match chars.next() {
                            Some((_, 'n')) => value.push('\n'),
                            Some((_, c @ ('\\' | '"'))) => value.push(c),
                            _ => return Err(at("bad escape in label value")),
                        },
                        Some((j, '"')) => break j,
                        Some((_, c)) => value.push(c),
                        None => return Err(at("unterminated label value")),
                    }
                };
                labels.insert(key.to_owned(), value);
                r = &v[end + 1..];
            }
        }
        let mut fields = rest.split_whitespace();
        let value = fields.next().ok_or_else(|| at("no value"))?;
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v.parse::<f64>().map_err(|_| at("value is not a number"))?,
        };
        if let Some(ts) = fields.next() {
            ts.parse::<i64>().map_err(|_| at("bad timestamp"))?;
        }
        out.push(Sample {
            name: name.to_owned(),
            labels,
            value,
        });
    }
    Ok(out)
}

fn valid_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    if ok {
        Ok(())
    } else {
        Err(format!("`{name}` is not a metric or label name"))
    }
}

/// The value of the sample `name` whose labels include `labels`.
pub fn sample_value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

/// The `deploy/` files that name postbox's metrics: the alert rules and the
/// Grafana dashboard.
pub const DEPLOY_FILES: [&str; 2] = [
    "deploy/prometheus/alerts.yml",
    "deploy/grafana/postbox.json",
];

/// A metric's family name: a histogram's `_bucket`, `_sum` and `_count`
/// series belong to it.
fn family(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

/// Every `postbox_…` metric family the [`DEPLOY_FILES`] name, with the file
/// that names it.
pub fn deploy_metric_names() -> std::collections::BTreeMap<String, &'static str> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut names = std::collections::BTreeMap::new();
    for file in DEPLOY_FILES {
        let text =
            std::fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let mut rest = text.as_str();
        while let Some(at) = rest.find("postbox_") {
            let word: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            rest = &rest[at + word.len()..];
            names.entry(family(&word).to_owned()).or_insert(file);
        }
    }
    assert!(
        !names.is_empty(),
        "no postbox_ metric named in {DEPLOY_FILES:?}"
    );
    names
}

/// Checks that every metric family the [`DEPLOY_FILES`] name with a name
/// that `owned` accepts is among the `samples` of a live `/metrics`.
pub fn assert_deploy_names_exported(samples: &[Sample], owned: impl Fn(&str) -> bool) {
    let live: std::collections::BTreeSet<&str> = samples.iter().map(|s| family(&s.name)).collect();
    let named = deploy_metric_names();
    let mut checked = 0;
    for (name, file) in named.iter().filter(|(n, _)| owned(n)) {
        assert!(
            live.contains(name.as_str()),
            "{file} names `{name}`, which a live /metrics does not export (it has: {live:?})"
        );
        checked += 1;
    }
    assert!(checked > 0, "no deploy metric checked");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_samples_and_rejects_garbage() {
        let text = "# HELP a_total Things.\n# TYPE a_total counter\na_total{x=\"1\",y=\"q\\\"z\"} 3\nb 1.5e3\nh_bucket{le=\"+Inf\"} 2\n";
        let s = parse_prometheus(text).unwrap();
        assert_eq!(sample_value(&s, "a_total", &[("y", "q\"z")]), Some(3.0));
        assert_eq!(sample_value(&s, "b", &[]), Some(1500.0));
        assert_eq!(s.len(), 3);
        assert!(parse_prometheus("a{x=1} 2").is_err());
        assert!(parse_prometheus("a 2 x").is_err());
        assert!(parse_prometheus("1a 2").is_err());
        assert!(parse_prometheus("# TYPE a countr").is_err());
    }
}

/// One request a [`Recorder`] received.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The request line's path.
    pub path: String,
    /// Header lines, lowercase names.
    pub headers: Vec<(String, String)>,
    /// The body's bytes (by `Content-Length`).
    pub body: Vec<u8>,
    /// When it came in.
    pub at: std::time::Instant,
}

impl Recorded {
    /// The first header named `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        (self.headers.iter())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// An HTTP/1.1 server on loopback that answers every request `200 OK`
/// (empty body) and records it: a webhook target, a consumer bridge's
/// handler, an OTLP/HTTP collector. It stops with the test's runtime.
#[derive(Debug, Clone)]
pub struct Recorder {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    requests: std::sync::Arc<std::sync::Mutex<Vec<Recorded>>>,
}

/// `200 OK` with an empty body.
const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";

impl Recorder {
    /// Listens on a free port, answering `200 OK` at once.
    pub async fn start() -> Recorder {
        Recorder::answering(std::time::Duration::ZERO, OK).await
    }

    /// Listens on a free port, answering every request with `answer` (a
    /// whole HTTP/1.1 response) after `hold`; the request is recorded as
    /// it comes in.
    pub async fn answering(hold: std::time::Duration, answer: &'static [u8]) -> Recorder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = requests.clone();
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                tokio::spawn(serve_recording(sock, seen.clone(), hold, answer));
            }
        });
        Recorder { url, requests }
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }

    /// The `Idempotency-Key` of every request so far, in order.
    pub fn keys(&self) -> Vec<String> {
        let requests = self.requests.lock().unwrap();
        (requests.iter())
            .filter_map(|r| r.header("idempotency-key").map(str::to_owned))
            .collect()
    }
}

/// Reads requests off one connection (keep-alive), recording each.
async fn serve_recording(
    mut sock: TcpStream,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Recorded>>>,
    hold: std::time::Duration,
    answer: &'static [u8],
) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let (head_end, len) = loop {
            if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..pos]).to_lowercase();
                let len = (head.lines())
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse::<usize>().unwrap_or(0));
                break (pos + 4, len);
            }
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        while buf.len() < head_end + len {
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let head = String::from_utf8_lossy(&buf[..head_end - 4]).into_owned();
        let mut lines = head.lines();
        let path = (lines.next().and_then(|l| l.split_whitespace().nth(1)))
            .unwrap_or("")
            .to_owned();
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let body = buf[head_end..head_end + len].to_vec();
        buf.drain(..head_end + len);
        seen.lock().unwrap().push(Recorded {
            path,
            headers,
            body,
            at: std::time::Instant::now(),
        });
        tokio::time::sleep(hold).await;
        if sock.write_all(answer).await.is_err() {
            return;
        }
    }
}
