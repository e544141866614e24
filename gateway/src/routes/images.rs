//! Images a project brings: pulled from an OCI registry by an edge, imported by an edge
//! from a tarball the caller uploads, or packed from one of its container sandboxes by
//! that sandbox's edge, and started by name (`image` in a
//! create). The built-in images (`busybox`, `base`, `code-interpreter-v1`)
//! are every edge's own and are not listed here.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use opendsec_commands::Command;
use opendsec_projections::{Right, State as Views};
use opendsec_sdk::types::{self as api, ImageList, ImagePushed, ImageWritten, PackSandbox, PullImage, PushImage};

use crate::convert;
use crate::error::ApiError;
use crate::extract::{Authed, PageQuery, Params, PathParam, RequestId, decode_json};
use crate::{AppState, Written, submit};

/// Registers an image and has an edge pull it. The answer comes once it is logged:
/// `state` is `pending` while the edge pulls (with `progress`), then `ready` (with its
/// digest) or `failed` (with the reason); poll `GET /v1/images/{name}`. Sandboxes may be
/// created from it at once: their edge pulls it too if it must. Pulling a name the
/// project has again pulls it again (a moved tag). Needs sandbox:write.
#[utoipa::path(post, path = "/v1/images", tag = "images", request_body = PullImage,
    responses((status = 201, body = ImageWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn pull(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    body: Bytes,
) -> Result<Written<ImageWritten>, ApiError> {
    let req: PullImage = decode_json(&body)?;
    let cmd = Command::PullImage {
        project: req.project.unwrap_or_else(|| who.0.project.clone()),
        name: req.name.unwrap_or_else(|| req.reference.clone()),
        reference: req.reference,
        edge: req.edge,
    };
    register(&st, &who, &rid, cmd).await
}

/// Imports an image from a tarball: the body is a docker-archive (`docker save`,
/// `skopeo copy … docker-archive:`) or an OCI image layout (`skopeo copy … oci-archive:`,
/// `oci-layout`, `index.json`, `blobs/`), gzipped or not, streamed to one edge (`edge`,
/// or one chosen), which verifies every blob's digest and each layer's diff_id, unpacks
/// the layers into its store and reports the image. The answer comes once the edge has
/// reported: 201 with the image `ready` (its digest, layers, size), or 400 with why the
/// tarball was refused (the image is then `failed`; nothing of it is kept). The image
/// lives in that edge's store only: creates of it go there. Importing a name the project
/// has replaces it. Needs sandbox:write.
#[utoipa::path(put, path = "/v1/images/{name}", tag = "images",
    params(
        ("name" = String, Path, description = "The image's name (a store name such as `my-env`, or a reference)"),
        ("project" = Option<String>, Query, description = "The project the image is registered in (default: the token's)"),
        ("edge" = Option<String>, Query, description = "The edge to import it on (default: one chosen)"),
    ),
    request_body(content = Vec<u8>, content_type = "application/x-tar", description = "The tarball (a docker-archive or an OCI layout, gzipped or not)"),
    responses((status = 201, body = ImageWritten), (status = "4XX", body = api::ErrorBody),
        (status = 502, body = api::ErrorBody, description = "The edge could not be reached; the image fails once the edge gives up waiting")))]
pub async fn import(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    Path(name): Path<String>,
    RawQuery(q): RawQuery,
    req: axum::extract::Request,
) -> Result<Written<ImageWritten>, ApiError> {
    use opendsec_edge_api::headers::{IMAGE_HEADER, IMPORT_INDEX_HEADER};
    let params = Params::parse(q.as_deref(), &["project", "edge"])?;
    let cmd = Command::ImportImage {
        project: params
            .one("project")?
            .map(str::to_string)
            .unwrap_or_else(|| who.0.project.clone()),
        name: name.clone(),
        edge: params.one("edge")?.map(str::to_string),
    };
    let s = submit(&st, &who, &rid, cmd).await?;
    let address = st
        .node
        .read(|v| {
            let edge = &v.images.images.get(&name)?.edge;
            v.placement.edges.get(edge).map(|e| e.address.clone())
        })
        .ok_or_else(|| ApiError::internal("the import was written but its edge is not in the applied state"))?;
    let (parts, body) = req.into_parts();
    let mut up = axum::http::Request::new(body);
    *up.method_mut() = axum::http::Method::PUT;
    let headers = up.headers_mut();
    if let Some(len) = parts.headers.get(axum::http::header::CONTENT_LENGTH) {
        headers.insert(axum::http::header::CONTENT_LENGTH, len.clone());
    }
    headers.insert(
        IMAGE_HEADER,
        name.parse()
            .map_err(|_| ApiError::invalid("name", "the image name is not a valid header value"))?,
    );
    headers.insert(IMPORT_INDEX_HEADER, s.index.into());
    let uri: axum::http::Uri = "/images/import".parse().expect("a valid path");
    let resp = crate::edge_client::forward(&st, &address, uri, up)
        .await
        .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, "unavailable", e.0))?;
    let status = resp.status();
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "unavailable",
                format!("reading the edge's answer: {e}"),
            )
        })?
        .to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if !status.is_success() {
        let why = v["message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| status.to_string());
        return Err(ApiError::new(
            if status.is_client_error() {
                status
            } else {
                StatusCode::BAD_GATEWAY
            },
            v["code"].as_str().unwrap_or("unavailable"),
            format!("the edge did not import image {name}: {why}"),
        ));
    }
    let index = v["index"].as_u64().unwrap_or(s.index);
    st.node
        .wait_applied(index, crate::extract::MIN_INDEX_WAIT)
        .await
        .map_err(|_| {
            ApiError::unavailable(format!(
                "the edge reported image {name} at index {index}, not applied here yet"
            ))
        })?;
    if v["state"] == "failed" {
        return Err(ApiError::invalid(
            "body",
            format!(
                "the tarball was refused: {}",
                v["reason"].as_str().unwrap_or("no reason given")
            ),
        ));
    }
    let image =
        read(&st, &name).ok_or_else(|| ApiError::internal("the image was imported but is not in the applied state"))?;
    Ok(Written {
        index,
        status: StatusCode::CREATED,
        body: ImageWritten { index, image },
    })
}

/// Pushes an image to an OCI registry: one the caller's sandboxes can start from (pulled,
/// imported, packed or built-in), written by the edge that holds it as an OCI image (its
/// layers as gzipped tars, its config with its Env, User, WorkingDir, Entrypoint, Cmd,
/// ExposedPorts and labels). Layers the registry has are not sent again. The answer
/// comes once the manifest is written: its digest pins exactly this image. A registry
/// on loopback is spoken to over plain HTTP; credentials and other plain-HTTP registries
/// are the edges' settings (`opendsec edge --registry-auth`, `--insecure-registry`).
/// Needs sandbox:write.
#[utoipa::path(post, path = "/v1/image-pushes", tag = "images", request_body = PushImage,
    responses((status = 200, body = ImagePushed), (status = "4XX", body = api::ErrorBody),
        (status = 502, body = api::ErrorBody, description = "The registry refused or could not be reached (the message says which and why)")))]
pub async fn push(State(st): State<AppState>, who: Authed, body: Bytes) -> Result<Json<ImagePushed>, ApiError> {
    let req: PushImage = decode_json(&body)?;
    who.require(Right::SandboxWrite)?;
    opendsec_commands::images::Reference::parse(&req.reference).map_err(|e| ApiError::invalid("reference", e))?;
    if req.reference.contains('@') {
        return Err(ApiError::invalid(
            "reference",
            "a push names a tag, not a digest (the registry computes the digest)",
        ));
    }
    if let Some(id) = &req.id {
        push_id(id)?;
    }
    let (edge, address) = push_edge(&st, &who, &req.image)?;
    let ask = serde_json::json!({"name": req.image, "reference": req.reference, "id": req.id});
    let (status, body) = crate::edge_client::call_with_body(
        &st,
        &address,
        axum::http::Method::POST,
        "/images/push",
        ask.to_string().into_bytes(),
    )
    .await
    .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, "unavailable", e.0))?;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if !(200..300).contains(&status) {
        let why = v["message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| status.to_string());
        return Err(match status {
            400 => ApiError::invalid("reference", why),
            404 => ApiError::not_found("image", format!("edge {edge} does not hold image {}: {why}", req.image)),
            _ => ApiError::new(StatusCode::BAD_GATEWAY, "push_failed", why),
        });
    }
    Ok(Json(ImagePushed {
        image: req.image,
        reference: v["reference"].as_str().unwrap_or_default().to_string(),
        digest: v["digest"].as_str().unwrap_or_default().to_string(),
        layers: v["layers"].as_u64().unwrap_or(0),
        bytes: v["bytes"].as_u64().unwrap_or(0),
        edge,
    }))
}

/// A push's id as the caller chose it: 1 to 64 letters, digits, `-` and `_`.
fn push_id(id: &str) -> Result<(), ApiError> {
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return Err(ApiError::invalid(
            "id",
            "a push's id is 1 to 64 letters, digits, '-' and '_'",
        ));
    }
    Ok(())
}

/// The edge (id, address) that pushes `image` for `who`: the one holding it, any edge
/// for a built-in image; 404 for an image the caller cannot see, 409 for one not ready.
fn push_edge(st: &AppState, who: &Authed, image: &str) -> Result<(String, String), ApiError> {
    st.node.read(|s| {
        let edge = match s.images.images.get(image) {
            Some(x) if usable(s, who, &x.project) => {
                if x.state != opendsec_projections::ImageState::Ready {
                    let mut e = ApiError::new(
                        StatusCode::CONFLICT,
                        "conflict",
                        format!(
                            "image {image} is not ready (pending or failed): only a ready image is pushed; \
                             `opendsecctl image get {image}` shows its state"
                        ),
                    );
                    e.body.field = Some("image".into());
                    return Err(e);
                }
                x.edge.clone()
            }
            _ if opendsec_commands::images::is_builtin(image) => s
                .placement
                .edges
                .values()
                .find(|e| !e.deregistered)
                .map(|e| e.id.clone())
                .ok_or_else(|| ApiError::unavailable("no edge is registered to push the image: start one"))?,
            _ => {
                return Err(ApiError::not_found(
                    "image",
                    format!("no image named {image} is visible to this token"),
                ));
            }
        };
        let address =
            s.placement.edges.get(&edge).map(|e| e.address.clone()).ok_or_else(|| {
                ApiError::unavailable(format!("edge {edge}, which holds the image, is not registered"))
            })?;
        Ok((edge, address))
    })
}

/// Where to read a push's progress: the image it pushes.
#[derive(serde::Deserialize, utoipa::IntoParams)]
pub struct PushProgressQuery {
    pub image: String,
}

/// The progress of a push under way, asked with `id` (`POST /v1/image-pushes` with
/// `"id"`), of image `image`: layers and bytes done and in all, the current step. 404
/// before the push starts and once it has ended (its answer says how). Needs sandbox:write.
#[utoipa::path(get, path = "/v1/image-pushes/{id}", tag = "images", params(("id" = String, Path), PushProgressQuery),
    responses((status = 200, body = api::ImagePushProgress), (status = "4XX", body = api::ErrorBody)))]
pub async fn push_progress(
    State(st): State<AppState>,
    who: Authed,
    axum::extract::Path(id): axum::extract::Path<String>,
    axum::extract::Query(q): axum::extract::Query<PushProgressQuery>,
) -> Result<Json<api::ImagePushProgress>, ApiError> {
    who.require(Right::SandboxWrite)?;
    push_id(&id)?;
    let (edge, address) = push_edge(&st, &who, &q.image)?;
    let (status, body) = crate::edge_client::get(&st, &address, &format!("/images/push/{id}"))
        .await
        .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, "unavailable", e.0))?;
    if status == 404 {
        return Err(ApiError::not_found(
            "id",
            format!("no push {id} of {} runs on edge {edge}", q.image),
        ));
    }
    if !(200..300).contains(&status) {
        return Err(ApiError::new(
            StatusCode::BAD_GATEWAY,
            "unavailable",
            format!("edge {edge} answered {status}"),
        ));
    }
    serde_json::from_slice(&body)
        .map(Json)
        .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, "unavailable", format!("edge {edge}: {e}")))
}

/// Makes an image of a container sandbox that has run (running or paused): its writable
/// layer becomes a layer on top of its image, made and kept by the sandbox's edge (a
/// running sandbox is frozen while its files are read). Left out: the agent's files, what
/// `/tmp`, `/var/tmp` and `/run` hold, shell histories, caches (`~/.cache`, apt's, Python's
/// `__pycache__`), and the `scrub` paths; setuid bits and file capabilities are dropped.
/// The answer comes once it is logged: `pending`, then `ready` or `failed`; poll
/// `GET /v1/images/{name}`. Sandboxes of the project and its descendants (and E2B
/// templates) start from it by name, on that edge. A microVM or full VM is refused
/// (snapshot it instead). Needs sandbox:write.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pack", tag = "images", params(("id" = String, Path)), request_body = PackSandbox,
    responses((status = 201, body = ImageWritten), (status = "4XX", body = api::ErrorBody)))]
pub async fn pack(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    PathParam(id): PathParam<String>,
    body: Bytes,
) -> Result<Written<ImageWritten>, ApiError> {
    let req: PackSandbox = decode_json(&body)?;
    let cmd = Command::PackSandbox {
        sandbox: id,
        name: req.name,
        scrub: req.scrub,
        config: None,
    };
    register(&st, &who, &rid, cmd).await
}

/// The images the caller's sandboxes can start from: its subtree's and its ancestors'.
/// Needs sandbox:read.
#[utoipa::path(get, path = "/v1/images", tag = "images", params(("limit" = Option<usize>, Query, description = "At most this many (1-1000, default 1000)"), ("page_token" = Option<String>, Query, description = "The next_page_token of the page before"),),
    responses((status = 200, body = ImageList), (status = "4XX", body = api::ErrorBody)))]
pub async fn list(State(st): State<AppState>, who: Authed, RawQuery(q): RawQuery) -> Result<Json<ImageList>, ApiError> {
    let page = PageQuery::parse(&Params::parse(q.as_deref(), &["limit", "page_token"])?)?;
    who.require(Right::SandboxRead)?;
    let beats = st.node.edge_heartbeats();
    let (images, next_page_token) = st.node.read(|s| {
        page.take(
            s.images
                .images
                .values()
                .filter(|x| usable(s, &who, &x.project))
                .map(|x| (x.name.clone(), convert::image(x, progress_of(&beats, &x.edge, &x.name)))),
        )
    });
    Ok(Json(ImageList {
        images,
        next_page_token,
    }))
}

/// One image. A name may hold `/` (references are names too): `GET /v1/images/127.0.0.1:5000/python:3.12`.
#[utoipa::path(get, path = "/v1/images/{name}", tag = "images", params(("name" = String, Path)),
    responses((status = 200, body = api::Image), (status = "4XX", body = api::ErrorBody)))]
pub async fn get(
    State(st): State<AppState>,
    who: Authed,
    Path(name): Path<String>,
) -> Result<Json<api::Image>, ApiError> {
    who.require(Right::SandboxRead)?;
    let beats = st.node.edge_heartbeats();
    st.node.read(|s| {
        let x = s
            .images
            .images
            .get(&name)
            .filter(|x| usable(s, &who, &x.project))
            .ok_or_else(|| ApiError::not_found("name", format!("no image named {name} is visible to this token")))?;
        Ok(Json(convert::image(x, progress_of(&beats, &x.edge, &x.name))))
    })
}

/// Removes an image's name: creates of it are 404 from then on. Sandboxes running it keep
/// their files. Needs sandbox:write in the image's project.
#[utoipa::path(delete, path = "/v1/images/{name}", tag = "images", params(("name" = String, Path)),
    responses((status = 200, body = api::Done), (status = "4XX", body = api::ErrorBody)))]
pub async fn delete(
    State(st): State<AppState>,
    who: Authed,
    rid: RequestId,
    Path(name): Path<String>,
) -> Result<Written<api::Done>, ApiError> {
    let s = submit(&st, &who, &rid, Command::DeleteImage { name }).await?;
    Ok(Written {
        index: s.index,
        status: StatusCode::OK,
        body: api::Done { index: s.index },
    })
}

/// Collects every edge's image store now: what no image record, live sandbox, snapshot,
/// fork, warm container or VM disk of any edge sharing the store uses (the edges also
/// collect after each `DELETE /v1/images/{name}` and hourly). The stores serve every
/// project, so it needs edge:write in the root project.
#[utoipa::path(post, path = "/v1/image-store/prune", tag = "images",
    responses((status = 200, body = api::Pruned), (status = "4XX", body = api::ErrorBody)))]
pub async fn prune(State(st): State<AppState>, who: Authed) -> Result<Json<api::Pruned>, ApiError> {
    who.require(opendsec_projections::Right::EdgeWrite)?;
    if !st.node.read(|s| who.is_root(s)) {
        return Err(ApiError::forbidden(
            "the image stores serve every project: pruning them needs a token of the root project",
        ));
    }
    let edges: Vec<(String, String)> = st.node.read(|s| {
        s.placement
            .edges
            .values()
            .filter(|e| !e.deregistered)
            .map(|e| (e.id.clone(), e.address.clone()))
            .collect()
    });
    let mut out = Vec::new();
    for (edge, address) in edges {
        let mut row = api::EdgePruned {
            edge: edge.clone(),
            layers: 0,
            disks: 0,
            scratch: 0,
            bytes: 0,
            error: None,
        };
        match crate::edge_client::call(&st, &address, axum::http::Method::POST, "/images/prune").await {
            Err(e) => row.error = Some(e.0),
            Ok((status, body)) => {
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                if (200..300).contains(&status) {
                    let n = |k: &str| v[k].as_u64().unwrap_or(0);
                    (row.layers, row.disks, row.scratch, row.bytes) =
                        (n("layers"), n("disks"), n("scratch"), n("bytes"));
                } else {
                    row.error = Some(
                        v["message"]
                            .as_str()
                            .map(str::to_string)
                            .unwrap_or_else(|| status.to_string()),
                    );
                }
            }
        }
        out.push(row);
    }
    Ok(Json(api::Pruned { edges: out }))
}

/// Whether the caller's sandboxes may start from an image of `project`: it is in the
/// caller's subtree, or an ancestor's.
fn usable(s: &Views, who: &Authed, project: &str) -> bool {
    who.sees(s, project) || s.within(&who.0.project, project)
}

fn progress_of<'a>(
    beats: &'a [opendsec_control::EdgeHeartbeat],
    edge: &str,
    name: &str,
) -> Option<&'a opendsec_control::PullProgress> {
    beats
        .iter()
        .find(|b| b.edge == edge)
        .and_then(|b| b.pulls.iter().find(|p| p.name == name))
}

fn read(st: &AppState, name: &str) -> Option<api::Image> {
    st.node
        .read(|s| s.images.images.get(name).map(|x| convert::image(x, None)))
}

/// Submits a command that registers an image (a pull, a pack) and answers 201 with the
/// image as applied.
async fn register(
    st: &AppState,
    who: &Authed,
    rid: &RequestId,
    cmd: Command,
) -> Result<Written<ImageWritten>, ApiError> {
    let s = submit(st, who, rid, cmd).await?;
    let image = read(st, &s.decided.target)
        .ok_or_else(|| ApiError::internal("the image was written but is not in the applied state"))?;
    Ok(Written {
        index: s.index,
        status: StatusCode::CREATED,
        body: ImageWritten { index: s.index, image },
    })
}
