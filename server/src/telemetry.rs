//! Logs and traces. `RUST_LOG` filters (default `info`); traces go to an OTLP
//! collector only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, and are off otherwise.

use opentelemetry::trace::TracerProvider as _;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Keeps the exporter alive; flushes spans when dropped.
pub struct Telemetry(Option<opentelemetry_sdk::trace::SdkTracerProvider>);

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = p.shutdown();
        }
    }
}

pub fn init() -> Telemetry {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,openraft=warn"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let provider =
        std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").and_then(|_| match opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
        {
            Ok(exporter) => Some(
                opentelemetry_sdk::trace::SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(
                        opentelemetry_sdk::Resource::builder()
                            .with_service_name("opendsec")
                            .build(),
                    )
                    .build(),
            ),
            Err(e) => {
                eprintln!("warning: OTLP exporter not started: {e}");
                None
            }
        });
    let otel = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("opendsec")));
    tracing_subscriber::registry().with(filter).with(fmt).with(otel).init();
    Telemetry(provider)
}
