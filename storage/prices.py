"""The price book: per-model prices per million tokens, batch discount, and cost maths.

Prices are integer micro-dollars per million tokens, so the cost of a request in
pico-dollars (1e-12 USD) is an exact integer: tokens * micros. Cached tokens are part of
`prompt_tokens` (OpenAI's convention) and are charged at the cached-input price.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

import sqlalchemy as sa

from sluice.storage.db import Database
from sluice.storage.errors import InvalidInput, StoreError
from sluice.storage.tables import ModelPrice, utcnow
from sluice.storage.tenants import check_text, to_decimal, usd_to_micros

PICOS_PER_MICRO = 1_000_000
# Per million tokens: a million tokens at this price still fits the ledger's BigInteger.
MAX_PRICE_USD = Decimal(1_000_000)
BASIS_POINTS = 10_000


@dataclass(frozen=True, slots=True)
class Price:
    model: str
    input_micros: int  # micro-dollars per million input tokens
    cached_input_micros: int
    output_micros: int
    batch_discount_bp: int = 0  # 5000 = half price on the batch lane

    def cost_picos(
        self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, *, batch: bool
    ) -> int:
        cached = min(cached_tokens, prompt_tokens)
        full = (
            (prompt_tokens - cached) * self.input_micros
            + cached * self.cached_input_micros
            + completion_tokens * self.output_micros
        )
        if batch and self.batch_discount_bp:
            # Round half up to the pico-dollar: the only rounding in the whole chain.
            return (full * (BASIS_POINTS - self.batch_discount_bp) + BASIS_POINTS // 2) // (
                BASIS_POINTS
            )
        return full

    def estimate_micros(self, prompt_tokens: int, max_tokens: int, *, batch: bool) -> int:
        """An upper bound for admission: no cache hits, every allowed token generated."""
        return picos_to_micros_ceil(self.cost_picos(prompt_tokens, 0, max_tokens, batch=batch))


def picos_to_micros_ceil(picos: int) -> int:
    return -(-picos // PICOS_PER_MICRO)


def picos_to_usd(picos: int) -> Decimal:
    return Decimal(picos).scaleb(-12)


def parse_discount(discount: Decimal | str) -> int:
    """0.5 → 5000 basis points; refuses values outside [0, 1) or finer than 0.01 %."""
    value = to_decimal(discount)
    bp = value * BASIS_POINTS
    if not value.is_finite() or not 0 <= value < 1 or bp != bp.to_integral_value():
        raise InvalidInput(f"batch discount must be a fraction in [0, 1), got {discount}")
    return int(bp)


class PriceBook:
    """Repository of model prices."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def set(
        self,
        model: str,
        *,
        input_usd: Decimal | str,
        cached_input_usd: Decimal | str,
        output_usd: Decimal | str,
        batch_discount: Decimal | str = "0",
    ) -> Price:
        price = Price(
            check_text(model, "model name"),
            usd_to_micros(input_usd, MAX_PRICE_USD),
            usd_to_micros(cached_input_usd, MAX_PRICE_USD),
            usd_to_micros(output_usd, MAX_PRICE_USD),
            parse_discount(batch_discount),
        )
        with self.db.session() as session:
            row = session.get(ModelPrice, price.model) or ModelPrice(model=price.model)
            row.input_micros = price.input_micros
            row.cached_input_micros = price.cached_input_micros
            row.output_micros = price.output_micros
            row.batch_discount_bp = price.batch_discount_bp
            row.updated_at = utcnow()
            session.add(row)
        return price

    def all(self) -> dict[str, Price]:
        with self.db.session() as session:
            return load_prices(session)


def load_prices(session: sa.orm.Session) -> dict[str, Price]:
    rows = session.scalars(sa.select(ModelPrice).order_by(ModelPrice.model))
    return {
        r.model: Price(
            r.model, r.input_micros, r.cached_input_micros, r.output_micros, r.batch_discount_bp
        )
        for r in rows
    }


class PriceCache:
    """Prices for admission estimates and quota settlement, refreshed every `ttl_s`.

    The ledger does not use it: it reads prices in its own transaction.
    """

    def __init__(
        self, book: PriceBook, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.book = book
        self.ttl_s = ttl_s
        self._clock = clock
        self._prices: dict[str, Price] = {}
        self._expires = -math.inf
        self._lock = threading.Lock()

    def get(self, model: str) -> Price | None:
        now = self._clock()
        if now >= self._expires:
            with self._lock:
                if now >= self._expires:
                    self._refresh(now)
        return self._prices.get(model)

    def _refresh(self, now: float) -> None:
        """Reload; when the database is down, keep serving the last prices for a while."""
        try:
            self._prices = self.book.all()
            self._expires = now + self.ttl_s
        except StoreError:
            if not self._prices:
                raise
            self._expires = now + min(self.ttl_s, 1.0)
