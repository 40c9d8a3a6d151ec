//! `amqps://` without touching the broker's config: a TLS-terminating proxy
//! on loopback (certificate from a throwaway CA) forwards to the plain AMQP
//! port. The publisher trusts the CA through `ca_file`.

use crate::rabbitmq_support;

use std::sync::Arc;
use std::time::Duration;

use postbox_core::publish::Delivery;
use postbox_core::redact::SecretUrl;
use postbox_core::Publisher;
use postbox_publishers::rabbitmq::RabbitMqPublisher;
use postbox_testkit::publisher_suite::sample_events;
use rabbitmq_support::*;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// Starts the proxy; returns its port and the CA certificate (PEM).
async fn tls_proxy() -> (u16, String) {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&leaf_key, &ca)
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
        )
        .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(server));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let upstream = plain_upstream();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(socket).await else {
                    return;
                };
                let Ok(mut plain) = TcpStream::connect(&upstream).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    (port, ca.pem())
}

/// `host:port` of the plain AMQP broker the tests use.
fn plain_upstream() -> String {
    let url = postbox_testkit::servers::amqp_url();
    let authority = url.split("://").nth(1).unwrap().split('/').next().unwrap();
    let hostport = authority.rsplit('@').next().unwrap();
    if hostport.contains(':') {
        hostport.to_owned()
    } else {
        format!("{hostport}:5672")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_through_a_tls_proxy_trusting_the_configured_ca() {
    let _broker = broker_shared().await;
    let (port, ca_pem) = tls_proxy().await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca_pem).unwrap();

    let exchange = scratch("tls");
    let setup = connect().await;
    let channel = setup.create_channel().await.unwrap();
    declare_exchange(&channel, &exchange).await;
    let inbox = consume(&setup, &exchange, "#").await;

    let mut config = config(&exchange, "{event_type}", false);
    config.url = SecretUrl::new(format!("amqps://guest:guest@127.0.0.1:{port}/%2f"));

    // Without the CA the certificate is not trusted.
    let err = RabbitMqPublisher::connect(&config)
        .await
        .err()
        .expect("an untrusted certificate must fail");
    assert!(!err.to_string().contains(":guest@"), "{err}");

    config.ca_file = Some(ca_file.display().to_string());
    let publisher = RabbitMqPublisher::connect(&config)
        .await
        .expect("amqps with ca_file");
    let events = sample_events("room", 20);
    let batch: Vec<Delivery<'_>> = events.iter().map(Delivery::of).collect();
    let results = publisher.publish(&batch).await;
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    let got = inbox.wait_for(20, Duration::from_secs(10)).await;
    assert_eq!(got.len(), 20);
    publisher.close().await;
}
