"""responses: stored responses of the Responses API and the events of background ones

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07 18:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(100), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("background", sa.Boolean(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("lease_until", sa.BigInteger(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_responses")),
    )
    op.create_index(op.f("ix_responses_status_lease_until"), "responses", ["status", "lease_until"])
    op.create_index(op.f("ix_responses_created_at"), "responses", ["created_at"])
    op.create_table(
        "response_events",
        sa.Column("response_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("event", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["response_id"],
            ["responses.id"],
            name=op.f("fk_response_events_response_id_responses"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("response_id", "seq", name=op.f("pk_response_events")),
    )


def downgrade() -> None:
    op.drop_table("response_events")
    op.drop_index(op.f("ix_responses_created_at"), table_name="responses")
    op.drop_index(op.f("ix_responses_status_lease_until"), table_name="responses")
    op.drop_table("responses")
