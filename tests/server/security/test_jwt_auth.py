"""Tenants' JWTs beside API keys: tokens signed in the test with keys generated in the
test (RS256, ES256, EdDSA), verified by a real server against a JWKS file or a JWKS URL
served by a real local aiohttp server; every forgery is a 401 that says nothing of the
keys or the claims, and a tenant's token never reaches another tenant's model."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jwt
import numpy as np
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from model_server.app import SERVER, ModelServer
from model_server.config import ServerConfig, parse_args
from model_server.errors import Unauthorized
from model_server.security.jwks import JwksUrl, parse_jwks
from model_server.security.jwt_auth import EXPIRED, INVALID, NOT_YET_VALID, JwtConfig, JwtVerifier
from tests.support.server import Version, add_version, infer_body, which_version

ISSUER = "https://issuer.test"
AUDIENCE = "model-rollout"
X = np.ones((1, 8), np.float32)
GENERIC = {INVALID, EXPIRED, NOT_YET_VALID}


@dataclass
class SigningKey:
    kid: str
    alg: str
    private: Any

    def jwk(self) -> dict[str, Any]:
        public = self.private.public_key()
        exporter = {"RS256": RSAAlgorithm, "ES256": ECAlgorithm, "EdDSA": OKPAlgorithm}[self.alg]
        return {**exporter.to_jwk(public, as_dict=True), "kid": self.kid, "use": "sig"}

    def public_pem(self) -> bytes:
        return self.private.public_key().public_bytes(  # type: ignore[no-any-return]
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def sign(self, claims: dict[str, Any], **header: Any) -> str:
        return jwt.encode(claims, self.private, self.alg, headers={"kid": self.kid, **header})


def new_key(alg: str, kid: str | None = None) -> SigningKey:
    private: Any
    if alg == "RS256":
        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    elif alg == "ES256":
        private = ec.generate_private_key(ec.SECP256R1())
    else:
        private = ed25519.Ed25519PrivateKey.generate()
    return SigningKey(kid or f"{alg.lower()}-{os.urandom(4).hex()}", alg, private)


def claims(tenant: str = "acme", **overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    base = {"iss": ISSUER, "aud": AUDIENCE, "sub": "user-1", "tenant": tenant}
    return {**base, "iat": now, "exp": now + 600, **overrides}


def write_jwks(path: Path, *keys: SigningKey) -> None:
    """Replace the file as a Secret's volume does: a new file renamed over the old."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"keys": [k.jwk() for k in keys]}))
    tmp.replace(path)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hand_made(header: dict[str, Any], payload: dict[str, Any], secret: bytes | None) -> str:
    """A token PyJWT would refuse to make: unsigned, or HMAC'd with any bytes."""
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"
    if secret is None:
        return signing_input + "."
    mac = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64(mac)}"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class Tenants:
    root: Path
    file: Path
    acme: dict[str, Version]
    globex: dict[str, Version]


@pytest.fixture
def tenants(tmp_path: Path) -> Tenants:
    """acme (an API key and JWTs) and globex (JWTs only) each with a model ``mlp`` of
    its own; globex also has ``secret``."""
    root = tmp_path / "models"
    acme = {"v1": add_version(root, "acme/mlp", "v1", seed=11)}
    globex = {"v1": add_version(root, "globex/mlp", "v1", seed=22)}
    add_version(root, "globex/secret", "v1", seed=33)
    file = tmp_path / "tenants.yaml"
    file.write_text(
        yaml.safe_dump(
            {
                "tenants": {
                    "acme": {"api_key": "key-acme", "models": ["mlp"]},
                    "globex": {"models": ["mlp", "secret"]},
                }
            }
        )
    )
    return Tenants(root, file, acme, globex)


def jwt_config(**where: Any) -> JwtConfig:
    return JwtConfig(issuer=ISSUER, audience=AUDIENCE, **where)


@pytest.fixture
def keys() -> dict[str, SigningKey]:
    return {alg: new_key(alg) for alg in ("RS256", "ES256", "EdDSA")}


@pytest.fixture
async def jwt_client(
    tmp_path: Path, tenants: Tenants, keys: dict[str, SigningKey]
) -> AsyncIterator[TestClient]:
    jwks = tmp_path / "jwks.json"
    write_jwks(jwks, *keys.values())
    config = ServerConfig(
        repository=tenants.root,
        tenants_file=tenants.file,
        jwt=jwt_config(jwks_file=jwks),
        cache_dir=tmp_path / "cache",
    )
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        yield client


async def infer(client: TestClient, token: str, model: str = "mlp") -> tuple[int, Any]:
    response = await client.post(
        f"/v2/models/{model}/infer", json=infer_body(X), headers=bearer(token)
    )
    return response.status, await response.json()


async def test_tokens_of_each_algorithm_reach_their_tenants_model(
    jwt_client: TestClient, tenants: Tenants, keys: dict[str, SigningKey]
) -> None:
    for key in keys.values():
        for tenant, versions in (("acme", tenants.acme), ("globex", tenants.globex)):
            status, answer = await infer(jwt_client, key.sign(claims(tenant)))
            assert status == 200, answer
            which_version(versions, X, answer)
    # the API key still works beside JWTs, and a token within the clock skew is valid
    response = await jwt_client.post(
        "/v2/models/mlp/infer", json=infer_body(X), headers={"X-API-Key": "key-acme"}
    )
    which_version(tenants.acme, X, await response.json())
    now = int(time.time())
    status, answer = await infer(jwt_client, keys["ES256"].sign(claims(exp=now - 10)))
    assert status == 200, answer
    status, answer = await infer(jwt_client, keys["EdDSA"].sign(claims(nbf=now + 10)))
    assert status == 200, answer


async def test_forged_and_invalid_tokens_are_401_saying_nothing(
    jwt_client: TestClient, keys: dict[str, SigningKey]
) -> None:
    rsa_key, now = keys["RS256"], int(time.time())
    impostor = new_key("RS256", kid=rsa_key.kid)  # same kid, another private key
    good = rsa_key.sign(claims())
    header, payload, signature = good.split(".")
    tampered = json.loads(base64.urlsafe_b64decode(payload + "=="))
    tampered["tenant"] = "globex"
    refused = {
        "expired beyond the skew": rsa_key.sign(claims(exp=now - 120)),
        "not yet valid beyond the skew": rsa_key.sign(claims(nbf=now + 120)),
        "wrong issuer": rsa_key.sign(claims(iss="https://evil.test")),
        "wrong audience": rsa_key.sign(claims(aud="someone-else")),
        "no expiry": rsa_key.sign({k: v for k, v in claims().items() if k != "exp"}),
        "no tenant claim": rsa_key.sign({k: v for k, v in claims().items() if k != "tenant"}),
        "an unconfigured tenant": rsa_key.sign(claims("initech")),
        "a tenant claim that is no string": rsa_key.sign(claims(["acme"])),  # type: ignore[arg-type]
        "forged signature": impostor.sign(claims()),
        "tampered claims": f"{header}.{b64(json.dumps(tampered).encode())}.{signature}",
        "unknown kid": new_key("ES256", kid="who-knows").sign(claims()),
        "no kid with several keys": jwt.encode(claims(), rsa_key.private, "RS256"),
        "alg none": hand_made({"alg": "none", "typ": "JWT", "kid": rsa_key.kid}, claims(), None),
        # the alg confusion attack: HS256 keyed with the published RSA public key
        "HS256 keyed with the RSA public key": hand_made(
            {"alg": "HS256", "typ": "JWT", "kid": rsa_key.kid}, claims(), rsa_key.public_pem()
        ),
        "ES256 claimed for the RSA key's kid": keys["ES256"].sign(claims(), kid=rsa_key.kid),
        "garbage in three parts": "abc.def.ghi",
    }
    for why, token in refused.items():
        status, body = await infer(jwt_client, token)
        assert status == 401, why
        assert body["code"] == "unauthorized" and body["error"] in GENERIC, (why, body)
        told = json.dumps(body)
        for secret in ("acme", "globex", "initech", ISSUER, "evil", rsa_key.kid, "who-knows"):
            assert secret not in told, (why, body)
    status, body = await infer(jwt_client, rsa_key.sign(claims(exp=now - 120)))
    assert body["error"] == EXPIRED


async def test_a_tenants_token_never_reaches_another_tenants_model(
    jwt_client: TestClient, tenants: Tenants, keys: dict[str, SigningKey]
) -> None:
    acme_token = keys["RS256"].sign(claims("acme"))
    status, body = await infer(jwt_client, acme_token, model="secret")  # only globex has it
    assert status == 404 and body["code"] == "model_not_found", body
    status, answer = await infer(jwt_client, acme_token)
    which_version(tenants.acme, X, answer)  # acme's mlp, never globex's
    for path in ("/v2/models/secret", "/v2/models/secret/ready"):
        response = await jwt_client.get(path, headers=bearer(acme_token))
        assert response.status == 404, path
    listing = await (await jwt_client.get("/v1/models", headers=bearer(acme_token))).json()
    assert [m["name"] for m in listing["models"]] == ["mlp"]
    globex = await jwt_client.get(
        "/v1/models", headers=bearer(keys["ES256"].sign(claims("globex")))
    )
    assert sorted(m["name"] for m in (await globex.json())["models"]) == ["mlp", "secret"]


async def test_a_rotated_jwks_file_is_read_again(
    tmp_path: Path, tenants: Tenants, keys: dict[str, SigningKey]
) -> None:
    old, new = keys["RS256"], new_key("RS256")
    jwks = tmp_path / "jwks.json"
    write_jwks(jwks, old)
    config = ServerConfig(
        repository=tenants.root,
        tenants_file=tenants.file,
        jwt=jwt_config(jwks_file=jwks),
        cache_dir=tmp_path / "cache",
    )
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        assert (await infer(client, new.sign(claims())))[0] == 401
        write_jwks(jwks, old, new)  # the new key published beside the old
        assert (await infer(client, new.sign(claims())))[0] == 200
        assert (await infer(client, old.sign(claims())))[0] == 200
        write_jwks(jwks, new)  # the old key retired
        assert (await infer(client, old.sign(claims())))[0] == 401
        assert (await infer(client, new.sign(claims())))[0] == 200
        jwks.write_text("{not json")  # a broken file keeps the keys read last
        assert (await infer(client, new.sign(claims())))[0] == 200


class JwksEndpoint:
    """A real JWKS server: counts its fetches, can rotate its keys or fail."""

    def __init__(self, *keys: SigningKey) -> None:
        self.keys = list(keys)
        self.fetches = 0
        self.failing = False
        app = web.Application()
        app.router.add_get("/jwks.json", self.handle)
        self.server = TestServer(app)

    async def handle(self, request: web.Request) -> web.Response:
        self.fetches += 1
        if self.failing:
            return web.json_response({"error": "down"}, status=503)
        return web.json_response({"keys": [k.jwk() for k in self.keys]})

    @property
    def url(self) -> str:
        return str(self.server.make_url("/jwks.json"))


@pytest.fixture
async def endpoint(keys: dict[str, SigningKey]) -> AsyncIterator[JwksEndpoint]:
    served = JwksEndpoint(keys["RS256"], keys["EdDSA"])
    await served.server.start_server()
    yield served
    await served.server.close()


async def test_a_jwks_url_is_cached_and_not_fetched_for_every_unknown_kid(
    tmp_path: Path, tenants: Tenants, keys: dict[str, SigningKey], endpoint: JwksEndpoint
) -> None:
    config = ServerConfig(
        repository=tenants.root,
        tenants_file=tenants.file,
        jwt=jwt_config(jwks_url=endpoint.url, min_refresh_s=3600, max_age_s=3600),
        cache_dir=tmp_path / "cache",
    )
    async with TestClient(TestServer(ModelServer(config).make_app())) as client:
        for _ in range(5):
            assert (await infer(client, keys["RS256"].sign(claims())))[0] == 200
        assert endpoint.fetches == 1  # cached
        storm = [new_key("ES256", kid=f"forged-{i}").sign(claims()) for i in range(30)]
        answers = await asyncio.gather(*(infer(client, token) for token in storm))
        assert {status for status, _ in answers} == {401}
        assert endpoint.fetches == 1  # within the minimum interval: no fetch at all
        endpoint.failing = True
        assert (await infer(client, keys["EdDSA"].sign(claims("globex"))))[0] == 200


async def test_jwks_url_refreshes_are_bounded_shared_and_survive_a_failing_endpoint(
    keys: dict[str, SigningKey], endpoint: JwksEndpoint
) -> None:
    now = [1000.0]
    source = JwksUrl(endpoint.url, ("RS256", "ES256", "EdDSA"), 10.0, 60.0, clock=lambda: now[0])
    verifier = JwtVerifier(jwt_config(jwks_url=endpoint.url), source)
    # a storm of unknown kids on a cold cache: one fetch, shared
    found = await asyncio.gather(*(source.key(f"nobody-{i}") for i in range(20)))
    assert found == [None] * 20 and endpoint.fetches == 1
    rotated = new_key("ES256")
    endpoint.keys.append(rotated)  # the issuer rotates in a new key
    with pytest.raises(Unauthorized, match=INVALID):  # seen within the minimum interval: no fetch
        await verifier.tenant_claim(rotated.sign(claims()))
    assert endpoint.fetches == 1
    now[0] += 10.0
    assert await verifier.tenant_claim(rotated.sign(claims())) == "acme"  # fetched for it
    assert endpoint.fetches == 2
    endpoint.failing = True
    now[0] += 120.0  # stale: answered from the cache at once, refetched behind it
    assert await verifier.tenant_claim(keys["RS256"].sign(claims("globex"))) == "globex"
    await source.refreshed()  # which fails: the cached keys still serve
    assert endpoint.fetches == 3
    assert await verifier.tenant_claim(rotated.sign(claims())) == "acme"
    assert endpoint.fetches == 3  # a failed attempt counts toward the minimum interval
    endpoint.failing, endpoint.keys = False, [rotated]  # back, the RSA key retired
    now[0] += 120.0
    assert await verifier.tenant_claim(keys["RS256"].sign(claims())) == "acme"  # cached
    await source.refreshed()
    assert endpoint.fetches == 4
    with pytest.raises(Unauthorized, match=INVALID):
        await verifier.tenant_claim(keys["RS256"].sign(claims()))
    assert await verifier.tenant_claim(rotated.sign(claims("globex"))) == "globex"


async def test_a_jwt_over_grpc_reaches_its_tenants_model_and_a_forged_one_is_refused(
    tmp_path: Path, tenants: Tenants, keys: dict[str, SigningKey]
) -> None:
    import tritonclient.grpc as grpcclient

    jwks = tmp_path / "jwks.json"
    write_jwks(jwks, keys["EdDSA"])
    config = ServerConfig(
        repository=tenants.root,
        tenants_file=tenants.file,
        jwt=jwt_config(jwks_file=jwks),
        grpc_port=0,
        cache_dir=tmp_path / "cache",
    )
    app = ModelServer(config).make_app()
    async with TestClient(TestServer(app)):
        port = app[SERVER].grpc.port  # type: ignore[union-attr]
        async with InferenceServerClient(f"127.0.0.1:{port}") as client:
            tensor = grpcclient.InferInput("input", list(X.shape), "FP32")
            tensor.set_data_from_numpy(X)
            token = keys["EdDSA"].sign(claims("globex"))
            result = await client.infer(
                "mlp", [tensor], headers={"authorization": f"Bearer {token}"}
            )
            expected = tenants.globex["v1"].expected(X)
            np.testing.assert_allclose(result.as_numpy("output"), expected, atol=1e-4)
            forged = new_key("EdDSA", kid=keys["EdDSA"].kid).sign(claims("globex"))
            with pytest.raises(InferenceServerException) as caught:
                await client.infer("mlp", [tensor], headers={"authorization": f"Bearer {forged}"})
            assert caught.value.status() == str(grpc.StatusCode.UNAUTHENTICATED)
            assert "globex" not in str(caught.value.message())


def test_symmetric_and_disallowed_keys_in_a_jwks_are_dropped(keys: dict[str, SigningKey]) -> None:
    oct_key = {"kty": "oct", "kid": "shared", "k": b64(b"secret" * 8)}
    parsed = parse_jwks(
        {"keys": [oct_key, keys["RS256"].jwk(), keys["ES256"].jwk()]}, ("RS256", "EdDSA")
    )
    assert set(parsed.by_kid) == {keys["RS256"].kid}
    with pytest.raises(ValueError, match="keys"):
        parse_jwks({"nope": []}, ("RS256",))


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--jwt-algorithms", "RS256,HS256"], "never 'none' or HS"),
        (["--jwt-algorithms", "none"], "never 'none' or HS"),
        (["--jwt-audience", ""], "an issuer and an audience"),
        (["--jwt-leeway-seconds", "3600"], "leeway"),
    ],
)
def test_unsafe_jwt_settings_refuse_to_start(
    tmp_path: Path, flags: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--repository", str(tmp_path), "--tenants-file", str(tmp_path / "t.yaml")]
    base += ["--jwks-url", "https://issuer.test/jwks", "--jwt-issuer", ISSUER]
    base += ["--jwt-audience", AUDIENCE]
    with pytest.raises(SystemExit):
        parse_args(base + flags)
    assert why in capsys.readouterr().err
    config = parse_args(base)
    assert config.jwt == jwt_config(jwks_url="https://issuer.test/jwks")
    with pytest.raises(SystemExit):  # a JWKS without tenants names no one
        parse_args(["--repository", str(tmp_path), "--jwks-url", "https://x.test/j"])
