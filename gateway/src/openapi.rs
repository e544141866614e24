//! The OpenAPI document, generated from the handlers' annotations and the wire types.

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::routes::*;

#[derive(OpenApi)]
#[openapi(
    info(title = "OpenDsec", description = "The native REST API of OpenDsec's control plane. Writes answer with the log index they were applied at (`X-Opendsec-Index`); send it back as `X-Opendsec-Min-Index` to read your writes on any node."),
    paths(
        crate::health, serve,
        projects::create, projects::list, projects::get, projects::delete, projects::set_quota, projects::get_quota, projects::set_network, projects::get_network, projects::set_rate_limits, projects::get_rate_limits,
        tokens::issue, tokens::list, tokens::revoke, tokens::whoami,
        sandboxes::create, sandboxes::list, sandboxes::get, sandboxes::kill, sandboxes::pause, sandboxes::resume,
        sandboxes::fork, sandboxes::set_timeout, sandboxes::set_labels, sandboxes::set_network, sandboxes::get_network, sandboxes::logs, sandboxes::metrics, sandboxes::metrics_history, agent::proxy,
        snapshots::create, snapshots::list, snapshots::get, snapshots::delete,
        images::pull, images::import, images::pack, images::list, images::get, images::delete, images::prune, images::push, images::push_progress,
        tasks::pause, tasks::resume,
        edges::list, edges::register, edges::deregister,
        audit::query, replay::replay,
        cluster::status, cluster::add_member, cluster::remove_member, cluster::get_retention, cluster::set_retention, cluster::rotate_certificates,
    ),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("odsec_<id>.<secret>")
                    .build(),
            ),
        );
    }
}

/// The OpenAPI 3.1 document of this API (public).
#[utoipa::path(get, path = "/v1/openapi.json", tag = "meta", security(()),
    responses((status = 200, description = "The OpenAPI document", content_type = "application/json")))]
pub async fn serve() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
