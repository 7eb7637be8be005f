mod identity;
