//! The dashboard: one page, plain JS and CSS, compiled into the binary (no
//! CDN, no build step). Served by `postbox serve` (the outbox: `/api/stats`,
//! `/api/events`) and by `postbox consume` (its consumers and their dead
//! letters: `/api/consumers`); it shows the parts its process serves.

use axum::http::header;
use axum::response::IntoResponse;

const INDEX: &str = include_str!("dashboard/index.html");
const SCRIPT: &str = include_str!("dashboard/dashboard.js");
const STYLE: &str = include_str!("dashboard/dashboard.css");

pub(crate) async fn index() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], INDEX)
}

pub(crate) async fn script() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        SCRIPT,
    )
}

pub(crate) async fn style() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE)
}
