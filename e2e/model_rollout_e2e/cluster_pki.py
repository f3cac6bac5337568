"""The certificates and keys of a test control plane, made with ``cryptography``: a CA, the
API server's serving certificate, client certificates for the admin and the components,
and the service-account signing key. Written as PEM files, the way the components read
them; nothing here is fit for anything but a throw-away cluster on loopback."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# the first address of the service range (--service-cluster-ip-range): the API server
# checks that its serving certificate names the `kubernetes` Service's address
SERVICE_RANGE = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"
VALIDITY = datetime.timedelta(days=2)


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class ClusterPKI:
    """All of a cluster's credentials under one directory."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        self._not_before = now - datetime.timedelta(minutes=5)  # clock steps between processes
        self._not_after = now + VALIDITY
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        self._ca_cert = self._sign(
            _name("model-rollout-test-ca"),
            self._ca_key.public_key(),
            ca=True,
            issuer=None,
        )
        self.ca = self._write("ca", self._ca_cert, self._ca_key)
        self.service_account_key, self.service_account_pub = self._service_account_key()

    def _sign(
        self,
        subject: x509.Name,
        public_key: ec.EllipticCurvePublicKey,
        ca: bool = False,
        issuer: x509.Certificate | None = None,
        usages: list[x509.ObjectIdentifier] | None = None,
        sans: list[x509.GeneralName] | None = None,
    ) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer.subject if issuer else subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._not_before)
            .not_valid_after(self._not_after)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_encipherment=not ca,
                    key_cert_sign=ca,
                    crl_sign=ca,
                    content_commitment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
        )
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self._ca_key, hashes.SHA256())  # self-signed for the CA

    def _write(
        self, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
    ) -> CertPair:
        pair = CertPair(self.dir / f"{name}.crt", self.dir / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(_key_pem(key))
        pair.key.chmod(0o600)
        return pair

    def _service_account_key(self) -> tuple[Path, Path]:
        """RSA: the key type every Kubernetes version signs service-account tokens with."""
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        private, public = self.dir / "sa.key", self.dir / "sa.pub"
        private.write_bytes(_key_pem(key))
        private.chmod(0o600)
        public.write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        return private, public

    def serving(self, name: str = "apiserver") -> CertPair:
        """The API server's certificate, for every name a client on loopback may use."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [
            x509.DNSName(dns)
            for dns in (
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            )
        ]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", SERVICE_IP)]
        cert = self._sign(
            _name(name),
            key.public_key(),
            issuer=self._ca_cert,
            usages=[ExtendedKeyUsageOID.SERVER_AUTH],
            sans=sans,
        )
        return self._write(name, cert, key)

    def client(self, name: str, user: str, group: str | None = None) -> CertPair:
        """A client certificate: the API server takes CN as the user and O as a group
        (``system:masters`` is cluster-admin whatever RBAC says)."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._sign(
            _name(user, group),
            key.public_key(),
            issuer=self._ca_cert,
            usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
        )
        return self._write(name, cert, key)
