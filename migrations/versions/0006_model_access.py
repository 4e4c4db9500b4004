"""model access: each tenant's allowed models, and the LoRA adapters loaded at run time

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-07 21:30:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # a plain ADD COLUMN, which SQLite runs without a table rebuild; NULL: every model
    op.add_column("tenants", sa.Column("allowed_models", sa.JSON(none_as_null=True)))
    op.create_table(
        "lora_adapters",
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("base_model", sa.String(200), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("owner_tenant_id", sa.String(40), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["owner_tenant_id"],
            ["tenants.id"],
            name=op.f("fk_lora_adapters_owner_tenant_id_tenants"),
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_lora_adapters")),
    )


def downgrade() -> None:
    op.drop_table("lora_adapters")
    with op.batch_alter_table("tenants") as batch:  # SQLite drops a column by a rebuild
        batch.drop_column("allowed_models")
